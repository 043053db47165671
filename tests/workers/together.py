"""Distributed worker: several worker scripts, one after the other, in one set of K stage processes.

Usage: python together.py K SCRIPT_DIR:SCRIPT [ARG ...] [-- SCRIPT_DIR:SCRIPT [ARG ...] ...]
Runs each ``tests/workers/SCRIPT`` as its ``__main__`` with ``sys.argv = [SCRIPT, SCRIPT_DIR, ARG ...]`` (or, if an
ARG is ``{out}``, with SCRIPT_DIR in its place), so it writes what it writes alone to SCRIPT_DIR; a script that
raises leaves SCRIPT_DIR/failed_rank{r}.txt (the traceback) and the next one runs. Importing Lightning costs
seconds per process, so the tests start K processes once for all the scripts that need K (see ``shared_run`` in
tests/conftest.py).

Lightning's launcher starts the other stage processes by re-running the command line of the main process, so they
are started first, from this script's own command line, before any script changes ``sys.argv``.
"""

import os
import runpy
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from torchvision_cpu import make_importable  # noqa: E402

make_importable()  # lightning imports torchmetrics, which imports torchvision (tests/torchvision_cpu.py)

import lightning as L  # noqa: E402

import lightning_gpipe  # noqa: E402

OUT = "{out}"
"""An argument that stands for the script's output directory."""


def runs(argv: list[str]) -> list[tuple[str, str, list[str]]]:
    """``(script, out_dir, args)`` of each run on the command line (runs are separated by ``--``)."""
    result, current = [], []
    for arg in [*argv, "--"]:
        if arg != "--":
            current.append(arg)
            continue
        out, script = current[0].rsplit(":", 1)
        result.append((script, out, current[1:]))
        current = []
    return result


def start_stage_processes(devices: int) -> None:
    """Start the other stage processes now (the launcher re-runs this command line; in them, this does nothing)."""
    trainer = L.Trainer(strategy=lightning_gpipe.GPipeStrategy(), accelerator="cpu", devices=devices, logger=False)
    trainer.strategy.launcher.launch(lambda: None)


if __name__ == "__main__":
    devices = int(sys.argv[1])
    planned = runs(sys.argv[2:])
    start_stage_processes(devices)
    rank = os.environ.get("LOCAL_RANK", "0")
    for script, out, args in planned:
        began = time.perf_counter()
        sys.argv = [script, *([out] if OUT not in args else []), *(out if arg == OUT else arg for arg in args)]
        try:
            runpy.run_path(os.path.join(os.path.dirname(__file__), script), run_name="__main__")
        except Exception:  # noqa: BLE001 - recorded for the test that reads this script's output
            with open(os.path.join(out, f"failed_rank{rank}.txt"), "w") as f:
                f.write(traceback.format_exc())
        if rank == "0":  # what each run costs the suite, for whoever keeps it short
            print(f"together: {time.perf_counter() - began:6.1f} s  {os.path.basename(out)}", file=sys.stderr)
