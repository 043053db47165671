"""One measurement of ``benchmarks/waits.py``: ``python benchmarks/_waits_run.py MODE KIND [options of _runs.py]``.

MODE ``interruptible`` runs the package as it is; ``blocking`` first puts back what the package did before its waits
became interruptible: every wait a plain ``Work.wait()`` in the main thread, and stage spans that do not move the
stall watchdog's position. The mode is kept in ``LIGHTNING_GPIPE_BENCH_WAITS`` for the stage processes Lightning's
launcher starts (it re-runs this script without the mode argument).
"""

import os
import runpy
import sys
from pathlib import Path

MODES = ("interruptible", "blocking")
_VARIABLE = "LIGHTNING_GPIPE_BENCH_WAITS"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository


def _blocking_waits() -> None:
    from lightning_gpipe import collectives, events, failure, waiting, watchdog

    def wait(works, peer):
        with failure.as_pipeline_failure():
            for work in works:
                work.wait()

    waiting.wait = collectives.wait = wait
    watchdog.TrackingRecorder.span = events.Recorder.span


if __name__ == "__main__":
    if sys.argv[1] in MODES:
        os.environ[_VARIABLE] = sys.argv.pop(1)
    if os.environ[_VARIABLE] == "blocking":
        _blocking_waits()
    runpy.run_path(str(Path(__file__).with_name("_runs.py")), run_name="__main__")
