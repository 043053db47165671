"""One measurement of ``benchmarks/agreement.py``: ``python benchmarks/_agreement_run.py MODE KIND [options of
_runs.py]``.

MODE ``agreeing`` runs the package as it is: before every step the processes all-reduce the batch fingerprints and
the stop requests (:mod:`lightning_gpipe.lightning.agreement`). ``trusting`` replaces that agreement by one that passes
this process's requests through, with no fingerprint and no collective, as before the check existed. The mode is kept in
``LIGHTNING_GPIPE_BENCH_AGREEMENT`` for the stage processes Lightning's launcher starts (it re-runs this script
without the mode argument).
"""

import os
import sys
from pathlib import Path

MODES = ("agreeing", "trusting")
_VARIABLE = "LIGHTNING_GPIPE_BENCH_AGREEMENT"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository


def _trusting() -> None:
    from lightning_gpipe.lightning.agreement import StepAgreement

    StepAgreement.agree = lambda self, batch, requests, where: list(requests)


if __name__ == "__main__":
    if sys.argv[1] in MODES:
        os.environ[_VARIABLE] = sys.argv.pop(1)
    if os.environ[_VARIABLE] == "trusting":
        _trusting()
    import _runs

    _runs.main(sys.argv[1:])  # not runpy: Lightning's launcher re-runs this script (sys.argv[0]) for the other stages
