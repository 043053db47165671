"""One run's process-wide machinery on this process: its failure board, its position and stall watchdog, its waiter.

The strategy creates a :class:`Job` in ``setup_environment`` (once the process group, hence the job's c10d store,
exists) and closes it in ``teardown``; what needs it gets it explicitly: the objects built per run (the links of a
stage, the tied parameters, the logging relay, the step agreement, the precision plugin's clipping, the backbone
call's position) at construction, the free functions (the waits and collectives of
:mod:`lightning_gpipe.faults.waiting`, the checkpoint gathers of :mod:`lightning_gpipe.lightning.state_dict`) as an
argument. Nothing of it lives in a module or class variable, so two jobs in one process (two tests, two runs) do not see
each other's position or failure.

Each part keeps its own module: :class:`~lightning_gpipe.faults.failure.FailureBoard` (the cause of a failure),
:class:`~lightning_gpipe.faults.watchdog.Position` and :class:`~lightning_gpipe.faults.watchdog.Watchdog` (where this
stage is, and who stopped progressing), :class:`~lightning_gpipe.faults.waiting.Waiter` (the helper threads of gloo
waits and sends).

A process that exits while a helper thread still waits for a transfer (a stage that failed in the middle of a step,
or whose neighbour did) must not leave that thread inside torch.distributed's C++ wait: Python ends such a daemon
thread when it next takes the interpreter lock, during finalization, and from inside C++ that ends the process by
``std::terminate`` (SIGABRT, exit code 134) instead of the error's exit code 1. :func:`end_waits_at_exit`, run at
interpreter exit, lets those waits end first: they do once the other stages' processes have exited.
"""

import atexit
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from lightning_gpipe.faults import waiting
from lightning_gpipe.faults.failure import FailureBoard
from lightning_gpipe.faults.waiting import Waiter
from lightning_gpipe.faults.watchdog import Position, Watchdog, end_process

EXIT_GRACE = 15.0
"""Seconds an exiting process gives its helper threads' waits to end (a failed stage's neighbours linger for 5 s
at most, then exit, which ends the waits on them) before it exits at once with code 1."""


class Job:
    """This process's part of one run: its failure board, position, stall watchdog and waiter.

    With a ``store``, creating a job counts this run on the store (see
    :class:`~lightning_gpipe.faults.failure.FailureBoard`) and starts the watchdog's heartbeat thread: every process of
    the job must create one per run. Without a store (one process, tests), nothing is published or read: failures
    are not reported, the stall limit is never reached, and waits still handle signals.

    Args:
        store: the job's key-value store (torch.distributed's default store), or ``None``.
        rank: this process's global rank.
        names: global rank -> name in messages (``"stage 1"``) of every process of the job; ``{rank: "stage
            <rank>"}`` by default.
        limit: seconds a stage may wait for another before the wait counts as a stall (no limit by default).
        limit_note: where ``limit`` comes from and how to raise it, for the stall's message (none by default).
        processes: the number of processes of the job, those a failing process waits for to read its cause
            (see :meth:`~lightning_gpipe.faults.failure.FailureBoard.linger`); ``len(names)`` by default.

    Attributes:
        board: the run's :class:`~lightning_gpipe.faults.failure.FailureBoard`.
        position: this stage's :class:`~lightning_gpipe.faults.watchdog.Position`.
        watchdog: the :class:`~lightning_gpipe.faults.watchdog.Watchdog` that publishes it and diagnoses stalls.
        waiter: the :class:`~lightning_gpipe.faults.waiting.Waiter` of :func:`lightning_gpipe.faults.waiting.wait` and
            of the links' sends (:meth:`~lightning_gpipe.faults.waiting.Waiter.watch`).

    Raises:
        RuntimeError: if ``store`` cannot be reached.
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        rank: int = 0,
        names: dict[int, str] | None = None,
        limit: float = float("inf"),
        processes: int | None = None,
        limit_note: str = "",
    ) -> None:
        names = dict(names) if names is not None else {rank: f"stage {rank}"}
        name = names.get(rank, f"rank {rank}")
        processes = processes if processes is not None else len(names)
        self.board = FailureBoard(store, name, processes, rank, names.get(0, "rank 0"))
        self.position = Position()
        self.watchdog = Watchdog(self.board, self.position, rank, names, limit, limit_note)
        self.waiter = Waiter()
        self.watchdog.start()

    def close(self) -> None:
        """End the run's part on this process: stop the heartbeat, stop publishing failures, end the waiter's threads.

        A closed job behaves as one without a store: waits still work (new waiter threads start if needed),
        nothing is published or read. Closing twice does nothing more.
        """
        self.watchdog.stop()
        self.board.close()
        self.waiter.close()

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def end_waits_at_exit(grace: float = EXIT_GRACE) -> None:
    """End the :class:`~lightning_gpipe.faults.waiting.Waiter` helper threads before the interpreter finalizes (run at
    exit, see the module docstring): tell each to end after its current wait and wait ``grace`` seconds for them; if
    one still waits then, flush the output and exit at once with code 1
    (:func:`~lightning_gpipe.faults.watchdog.end_process`: a transfer still pending at exit means the run failed)."""
    threads = [thread for thread in threading.enumerate() if isinstance(thread, waiting._Thread)]
    for thread in threads:
        thread.batches.put(None)  # the end of its queue; a thread already told to end has left it
    deadline = time.monotonic() + grace
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    if any(thread.is_alive() for thread in threads):
        print(f"[lightning_gpipe] exiting with a transfer still pending after {grace:g} s", file=sys.stderr)
        sys.stdout.flush(), sys.stderr.flush()
        end_process()


atexit.register(end_waits_at_exit)
