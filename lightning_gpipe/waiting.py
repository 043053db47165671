"""Waiting for transfers and collectives so that signals are handled, a failed stage is noticed, and a stall named.

A ``Work.wait()`` blocks in C++, where Python runs no signal handler: a stage blocked on a neighbour that
hangs could not be stopped by Ctrl-C, SIGTERM or SLURM's requeue signal. gloo's point-to-point works
cannot be polled (``is_completed()`` stays ``False`` until ``wait()`` returns) and a ``wait(timeout)`` that
times out closes the connection. So one helper thread per process (:class:`_Waiter`, with those signals
blocked) calls ``wait()``, and the main thread waits for the helper on a lock, which Python interrupts
for signal handlers. Every :data:`TICK` seconds of a long wait the main thread also reads the failure
board (a stage that failed stops the others even when it cannot exit) and asks the stall watchdog
(:mod:`lightning_gpipe.watchdog`) whether the wait has lasted too long.

The cost is one thread hand-off per wait (tens of microseconds); ``benchmarks/waits.py`` measures it
against plain blocking waits. A receive whose sender has already issued the matching send in the same call as
a message already received (an activation's payload after its header) ends with the transport alone, so
:func:`wait_in_flight` waits for it on the calling thread, without the hand-off.
"""

import queue
import signal
import threading
import time
from typing import Optional

import torch.distributed as dist

from lightning_gpipe import failure, watchdog

TICK = 1.0
"""Seconds between two looks at the failure board and the stall limit while a wait lasts."""

EVERY_STAGE = "every stage"
"""The peer of a collective."""


class _Job:
    """Works to wait for, and how the waiter tells it is done."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works
        self.error: Optional[BaseException] = None
        self.done = threading.Lock()
        self.done.acquire()


class _Waiter(threading.Thread):
    """Waits for the works of each job in turn, then releases the job's lock."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="lightning-gpipe-waiter")
        self.jobs: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()

    def run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})
        while True:
            job = self.jobs.get()
            try:
                for work in job.works:
                    work.wait()
            except BaseException as error:  # handed to the main thread, which raises it
                job.error = error
            job.done.release()


_waiter: Optional[_Waiter] = None


def _submit(job: _Job) -> None:
    global _waiter
    if _waiter is None or not _waiter.is_alive():
        _waiter = _Waiter()
        _waiter.start()
    _waiter.jobs.put(job)


def wait(works: list[dist.Work], peer: str) -> None:
    """Wait until every work in ``works`` has completed, handling signals meanwhile.

    Args:
        works: works of point-to-point transfers or asynchronous collectives (``async_op=True``).
        peer: whom the works wait for, for the position and messages: ``"stage 0"``, or :data:`EVERY_STAGE`.

    Raises:
        PipelineFailure: if a transfer failed (naming the published cause), another stage published a
            failure while this one waited, or the wait lasted longer than the stall limit (naming the
            stage that stopped progressing).
    """
    if not works:
        return
    job = _Job(works)
    _submit(job)
    started = time.monotonic()
    with watchdog.waiting(peer), failure.as_pipeline_failure(detail=watchdog.last_positions):
        while not job.done.acquire(timeout=TICK):
            _check(peer, time.monotonic() - started)
        if job.error is not None:
            raise job.error


def wait_in_flight(works: list[dist.Work]) -> None:
    """Wait for ``works`` on this thread, without :func:`wait`'s hand-off to the helper thread.

    Only for receives whose sender has already issued the matching sends, in the same call as a message this
    stage has received (an activation's payload, sent right after its header): their end depends on the
    transport alone, not on the peer's progress, and a peer that dies closes the connection, which ends the
    wait. Signals are handled once the bytes have arrived.

    Args:
        works: works of point-to-point receives.

    Raises:
        PipelineFailure: if a transfer failed (naming the published cause).
    """
    with failure.as_pipeline_failure(detail=watchdog.last_positions):
        for work in works:
            work.wait()


def _check(peer: str, waited: float) -> None:
    """Raise if the job failed elsewhere or this wait counts as a stall."""
    cause = failure.published_cause()
    if cause is not None:
        raise failure.stopped_because(cause)
    if waited <= watchdog.limit():
        return
    stall = watchdog.diagnose(peer, waited)
    if stall is None:
        return
    message, culprit = stall
    cause = failure.publish(message) or message
    if culprit is not None:
        watchdog.mark_stalled(culprit)
    raise failure.stopped_because(cause)
