"""One measurement of ``benchmarks/waits.py``: ``python benchmarks/_waits_run.py MODE KIND [options of _runs.py]``,
or ``python benchmarks/_waits_run.py MODE pingpong --rounds R --size S --warmup W --steps T`` (2 processes, see
:func:`ping_pong`).

MODE ``interruptible`` runs the package as it is; ``blocking`` first puts back what the package did before its waits
became interruptible: every wait a plain ``Work.wait()`` in the main thread (transfers the links watch as they are
posted included: no helper thread at all), and stage spans that do not move the stall watchdog's position. The mode is
kept in ``LIGHTNING_GPIPE_BENCH_WAITS`` for the stage processes Lightning's launcher starts (it re-runs this script
without the mode argument).
"""

import argparse
import os
import runpy
import sys
from pathlib import Path

MODES = ("interruptible", "blocking")
_VARIABLE = "LIGHTNING_GPIPE_BENCH_WAITS"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository


class _Blocking:
    """Works the main thread waits for itself, in place of a :class:`~lightning_gpipe.faults.waiting.Watched`:
    complete only once waited for (gloo's works cannot be polled), so the links keep sends until a flush."""

    def __init__(self, works: list) -> None:
        self.works, self.done, self.error = works, False, None

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        if not self.done:
            try:
                for work in self.works:
                    work.wait()
            except BaseException as error:  # raised at every wait, as a Watched does
                self.error = error
            self.works, self.done = [], True
        if self.error is not None:
            raise self.error
        return True


def _blocking_waits() -> None:
    from contextlib import nullcontext

    from lightning_gpipe.engine import events
    from lightning_gpipe.faults import waiting, watchdog

    def wait(job, works, peer):
        with job.board.as_pipeline_failure():
            for work in works:
                work.wait()

    waiting.wait = wait  # looked up at each call by the links and the collectives
    waiting.wait_watched = lambda job, watched, peer: wait(job, [watched], peer)
    waiting.Waiter.watch = lambda self, works, stream: _Blocking(works)  # no helper thread per stream
    events.TrackingRecorder.span = events.Recorder.span  # a recording span: the position stays
    watchdog.Position.span = lambda self, *args: nullcontext()  # the span while nothing records: nothing at all


def ping_pong(argv: list[str]) -> None:
    """Global rank 0 sends ``--size`` floats to rank 1, which sends them back, ``--rounds`` times per measured
    "step"; every send and receive is waited for at once through ``waiting.wait`` (so each round trip is four
    waits on its critical path, two per process), as the stages wait for a transfer. No compute: the figure is the
    cost of a wait itself."""
    import _harness as harness
    import torch
    import torch.distributed as dist

    from lightning_gpipe.faults import waiting
    from lightning_gpipe.faults.job import Job

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer, name = 1 - rank, f"stage {1 - rank}"
    buffer = torch.zeros(args.size)
    job = Job(rank=rank)  # no store, as the package's waits outside a run: no board or stall limit to read
    clock = harness.StepClock(args.warmup)
    for _ in range(args.warmup + args.steps):
        for _ in range(args.rounds):
            for send in (rank == 0, rank == 1):
                work = dist.isend(buffer, peer) if send else dist.irecv(buffer, peer)
                waiting.wait(job, [work], name)  # looked up at each call: the blocking mode replaces it
        clock.mark()
    harness.emit(rank, **clock.summary())
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] in MODES:
        os.environ[_VARIABLE] = sys.argv.pop(1)
    if os.environ[_VARIABLE] == "blocking":
        _blocking_waits()
    if sys.argv[1] == "pingpong":
        ping_pong(sys.argv[2:])
    else:
        runpy.run_path(str(Path(__file__).with_name("_runs.py")), run_name="__main__")
