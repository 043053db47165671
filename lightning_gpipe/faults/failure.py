"""The failure board: naming the cause when one stage of the pipeline fails.

When a stage raises, its neighbours are blocked in a send or receive to it. The
failing process writes its error to the job's key-value store (the c10d store that
torch.distributed already shares) before it exits; its exit closes its
connections, so a neighbour's pending transfer fails, and that neighbour raises
:class:`PipelineFailure` carrying the first stage's error instead of a bare
"connection closed". A stage that waits reads the board while it waits too
(:mod:`lightning_gpipe.faults.waiting`), so it also stops when the failed stage cannot exit
(stuck in user code). The failure then cascades, each process exiting non-zero with
the original cause named.

The report must work when the failure is an out-of-memory error: what it needs is
prepared when the board is created (the store connection, the stage's name, a small
memory reserve that :meth:`FailureBoard.report` releases before it formats anything).

Each run of the strategy (each ``Trainer.fit``, ``validate``...) creates a :class:`FailureBoard` of its own
(part of the run's :class:`lightning_gpipe.faults.job.Job`), numbered in the store, so a failure of an earlier run in
the same processes is not read as the cause of a later one. The module keeps no state of its own.
"""

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

_PREFIX = "lightning_gpipe/failure"
_WAIT_FOR_CAUSE = timedelta(seconds=10)
_LINGER = 5.0  # seconds a failing process waits for every process to read the cause before it goes on to exit
_RESERVE_BYTES = 4 * 2**20


class PipelineFailure(RuntimeError):
    """Raised on a stage whose neighbour failed or stopped progressing, while it waited for it: a consequence, not a
    cause.

    The message names the stage that failed first and its error, e.g. ``"stage 0 stopped because stage 1 failed with
    TypeError: Backbone layer 8 (Returns) returned a dict; ... (at partition.py:74)"``, or the stage that stopped
    progressing and where it was (``"... has been in `training_step` after the backbone call at step 2 for 300
    s"``, see :class:`~lightning_gpipe.faults.watchdog.Watchdog`). The failed stage itself raises its own error;
    every process of the job exits with code 1 (see :mod:`lightning_gpipe.faults.failure`). Raised by
    :class:`~lightning_gpipe.faults.failure.FailureBoard` from the package's waits (transfers and collectives).

    Attributes:
        args: ``(message,)``, the message above. When a transfer itself failed (the other process ended), the
            exception is chained (``__cause__``) to torch.distributed's error.
    """


class FailureBoard:
    """This process's failure board for one run: where it publishes its failure and reads the job's.

    Created once per run by every process of the job (by :class:`lightning_gpipe.faults.job.Job`, at the strategy's
    ``setup_environment``). The runs are numbered in the store: each process counts the boards it created on
    ``store`` (one ``store.add`` on a key of its own), and every process creates one per run, so all processes of a
    run use the same number and a failure of an earlier run in the same processes is not read by a later one.

    Args:
        store: the job's key-value store (shared by all processes of the job); ``None`` for a board that publishes
            and reads nothing (a single process, or after :meth:`close`).
        name: how the messages name this process, e.g. ``"stage 1"`` (see
            :meth:`lightning_gpipe.engine.topology.Topology.name`).
        processes: the number of processes of the job (those :meth:`linger` waits for).
        rank: this process's global rank (the key it counts its boards under).
        holder: the name of global rank 0, whose process holds the store (named when the store is lost).

    Raises:
        RuntimeError: if the store cannot be reached.
    """

    def __init__(
        self,
        store: dist.Store | None = None,
        name: str = "stage 0",
        processes: int = 1,
        rank: int = 0,
        holder: str = "stage 0",
    ):
        self.store, self.name, self.processes, self.holder = store, name, processes, holder
        self.generation = store.add(f"{_PREFIX}/boards/{rank}", 1) if store is not None else 0
        self.reserve = bytearray(_RESERVE_BYTES) if store is not None else None
        self.read = False  # whether this process counted itself among those that know the cause

    def close(self) -> None:
        """Stop publishing failures (after a run); :meth:`report` then does nothing."""
        self.store, self.reserve = None, None

    def key(self, topic: str) -> str:
        """The store key of ``topic`` on this run's board (other modules publish next to the failure cause)."""
        return f"{_PREFIX}/{self.generation}/{topic}"

    def report(self, exception: BaseException) -> None:
        """Publish this stage's exception as the job's failure cause, unless a cause was published already.

        A :class:`PipelineFailure` is a consequence, not a cause, and is not published. Safe to call when memory
        is short: it releases the board's reserve first and reads no source file.
        """
        if self.store is None or isinstance(exception, PipelineFailure):
            return
        self.reserve = None  # frees room for the message and the store's messages
        self.publish(f"{self.name} failed with {type(exception).__name__}: {exception}{_where(exception)}")

    def publish(self, cause: str) -> str | None:
        """Publish ``cause`` as the job's failure cause unless one was published first; return the job's cause.

        Returns:
            The cause on the board (``cause`` if it was the first), or ``None`` when the store cannot be reached
            (it lives in global rank 0's process, which may be gone) or the board has none.
        """
        if self.store is None:
            return None
        try:
            published = self.store.compare_set(self.key("cause"), "", cause).decode()
            self._acknowledge()
            return published
        except RuntimeError:
            return None

    def _acknowledge(self) -> None:
        """Count this process among those that know the job's cause, for :meth:`linger` (once per run)."""
        if not self.read:
            self.read = True
            assert self.store is not None  # its callers read the cause from the store
            self.store.add(self.key("read"), 1)

    def published_cause(self, wait: timedelta = timedelta(0)) -> str | None:
        """The job's published failure cause, waiting up to ``wait`` for one; ``None`` if there is none (yet).

        Raises:
            RuntimeError: if the store cannot be reached (global rank 0's process is gone).
        """
        store = self.store
        if store is None:
            return None
        if wait:
            try:
                store.wait([self.key("cause")], wait)
            except RuntimeError:
                pass  # timed out, or the store is gone: `check` tells which
        if not store.check([self.key("cause")]):
            return None
        cause = store.get(self.key("cause")).decode()
        self._acknowledge()
        return cause

    def linger(self) -> None:
        """After a failure, wait until every process of the job has read its cause (a few seconds at most).

        The store lives in global rank 0's process, and Lightning's launcher kills every stage once one has
        exited: a failing process that exited at once could take the cause with it, or get the others killed
        before they read and named it. Returns at once when the store cannot be reached (global rank 0's process
        has ended): no process can read the cause there any more.
        """
        try:
            if self.store is None or self.published_cause() is None:
                return
            deadline = time.monotonic() + _LINGER
            while self.store.add(self.key("read"), 0) < self.processes and time.monotonic() < deadline:
                time.sleep(0.05)
        except RuntimeError:  # the store went with global rank 0's process
            return

    def store_lost(self) -> str:
        """What a lost store means, for messages: ``"global rank 0's process (stage 0) has ended: the job's store,
        which lives in it, cannot be reached"``."""
        holder = f"global rank 0's process ({self.holder})"
        return f"{holder} has ended: the job's store, which lives in it, cannot be reached"

    @contextmanager
    def as_pipeline_failure(self, detail: Callable[[], str] | None = None) -> Iterator[None]:
        """Turn a failed transfer or collective inside the block into a :class:`PipelineFailure` naming the cause.

        Args:
            detail: says what is known of the other stages when no cause was published (e.g. where each stage
                last was); by default the transport's error alone is named.

        Raises:
            PipelineFailure: as :meth:`failure` makes it.
        """
        try:
            yield
        except RuntimeError as error:
            self.raise_failure(error, detail)

    def raise_failure(self, error: BaseException, detail: Callable[[], str] | None = None) -> NoReturn:
        """Raise ``error``, a failed transfer's or collective's, as the :class:`PipelineFailure` it stands for
        (:meth:`failure`); a :class:`PipelineFailure` or an error of another type as it is.

        The waits call it in an ``except`` clause rather than entering :meth:`as_pipeline_failure`: on their path,
        taken many times a step, failure code runs only on a failure.
        """
        if isinstance(error, RuntimeError) and not isinstance(error, PipelineFailure):
            raise self.failure(error, detail) from error
        raise error

    def failure(self, error: RuntimeError, detail: Callable[[], str] | None = None) -> PipelineFailure:
        """The :class:`PipelineFailure` a failed transfer or collective (torch.distributed's ``error``) stands for:
        the published cause (waiting a few seconds for one); the loss of global rank 0's process when the store
        cannot be reached (:meth:`store_lost`); else the transport's error and ``detail`` (e.g. where each stage
        was last seen)."""
        try:
            cause = self.published_cause(_WAIT_FOR_CAUSE)
        except RuntimeError:
            return PipelineFailure(f"{self.name} stopped because {self.store_lost()} ({error})")
        if cause is None:
            more = f"; {detail()}" if detail is not None else ""
            return PipelineFailure(f"{self.name}: another stage stopped responding ({error}){more}")
        return PipelineFailure(f"{self.name} stopped because {cause}")

    def stopped_because(self, cause: str) -> PipelineFailure:
        """The :class:`PipelineFailure` this stage raises when it stops because of the job's ``cause``."""
        if cause.startswith(f"{self.name} "):
            return PipelineFailure(cause)
        return PipelineFailure(f"{self.name} stopped because {cause}")

    def say(self, message: str) -> None:
        """Write ``message`` to this process's stderr at once (see :func:`say`)."""
        say(self.name, message)


def say(name: str, message: str) -> None:
    """Write ``message`` to this process's stderr at once, as ``[name] message`` (also when the process is about to
    end abruptly)."""
    with suppress(OSError, ValueError):  # a closed or broken stderr: nothing left to tell
        sys.stderr.write(f"[{name}] {message}\n")
        sys.stderr.flush()


def _where(exception: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exception``'s traceback, without reading source files."""
    tb = exception.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
