"""One measurement of ``benchmarks/agreement.py``: ``python benchmarks/_agreement_run.py MODE KIND [options of
_runs.py]``.

MODE ``agreeing`` runs the package as it is: in every step the processes all-reduce the batch fingerprints, the stop
requests and the logged values' description (:mod:`lightning_gpipe.lightning.agreement`). ``trusting`` takes no
fingerprint of the batch (every process gives the same constant): the all-reduce stays, since it carries the stop
requests and the relay of the last stage's logged values, which a run needs with or without the check. The mode is
kept in ``LIGHTNING_GPIPE_BENCH_AGREEMENT`` for the stage processes Lightning's launcher starts (it re-runs this
script without the mode argument).
"""

import os
import sys
from pathlib import Path

MODES = ("agreeing", "trusting")
_VARIABLE = "LIGHTNING_GPIPE_BENCH_AGREEMENT"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository


def _trusting() -> None:
    import torch

    from lightning_gpipe.lightning import agreement

    agreement.fingerprint = lambda batch: torch.zeros((), dtype=torch.int64)


if __name__ == "__main__":
    if sys.argv[1] in MODES:
        os.environ[_VARIABLE] = sys.argv.pop(1)
    if os.environ[_VARIABLE] == "trusting":
        _trusting()
    import _runs

    _runs.main(sys.argv[1:])  # not runpy: Lightning's launcher re-runs this script (sys.argv[0]) for the other stages
