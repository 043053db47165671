"""The failure board: naming the cause when one stage of the pipeline fails.

When a stage raises, its neighbours are blocked in a send or receive to it. The
failing process writes its error to the job's key-value store (the c10d store that
torch.distributed already shares) before it exits; its exit closes its
connections, so a neighbour's pending transfer fails, and that neighbour raises
:class:`PipelineFailure` carrying the first stage's error instead of a bare
"connection closed". A stage that waits reads the board while it waits too
(:mod:`lightning_gpipe.waiting`), so it also stops when the failed stage cannot exit
(stuck in user code). The failure then cascades, each process exiting non-zero with
the original cause named.

The report must work when the failure is an out-of-memory error: what it needs is
prepared when the board is attached (the store connection, the stage's name, a small
memory reserve that :func:`report` releases before it formats anything).

Each run of the strategy (each ``Trainer.fit``, ``validate``...) gets a board of its
own (a generation), so a failure of an earlier run in the same processes is not read
as the cause of a later one.
"""

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

_PREFIX = "lightning_gpipe/failure"
_WAIT_FOR_CAUSE = timedelta(seconds=10)
_LINGER = 5.0  # seconds a failing process waits for every process to read the cause before it goes on to exit
_RESERVE_BYTES = 4 * 2**20


class PipelineFailure(RuntimeError):
    """Raised on a stage whose neighbour failed or stopped progressing; the message names that stage and its error."""


class _Board:
    store: Optional[dist.Store] = None
    name: str = "stage 0"
    generation: int = 0
    reserve: Optional[bytearray] = None
    processes: int = 1
    read: bool = False


def attach(store: dist.Store, name: str, processes: int = 1) -> None:
    """Use ``store`` (shared by all processes of the job) for this run's failures; ``name`` names this process.

    Every process of the job must attach once per run (the runs are numbered by the attach calls).

    Args:
        store: the job's key-value store.
        name: how the messages name this process, e.g. ``"stage 1"`` (see :func:`lightning_gpipe.watchdog.name`).
        processes: the number of processes of the job.
    """
    _Board.store, _Board.name = store, name
    _Board.processes, _Board.read = processes, False
    _Board.generation += 1
    _Board.reserve = bytearray(_RESERVE_BYTES)


def detach() -> None:
    """Stop publishing failures (after a run); :func:`report` then does nothing."""
    _Board.store, _Board.reserve = None, None


def stage_name() -> str:
    """How the messages name this process (``"stage 1"``), as given to :func:`attach`."""
    return _Board.name


def key(topic: str) -> str:
    """The store key of ``topic`` on this run's board (other modules publish next to the failure cause)."""
    return f"{_PREFIX}/{_Board.generation}/{topic}"


def report(exception: BaseException) -> None:
    """Publish this stage's exception as the job's failure cause, unless a cause was published already.

    A :class:`PipelineFailure` is a consequence, not a cause, and is not published. Safe to call when memory
    is short: it releases the board's reserve first and reads no source file.
    """
    if _Board.store is None or isinstance(exception, PipelineFailure):
        return
    _Board.reserve = None  # frees room for the message and the store's messages
    publish(f"{_Board.name} failed with {type(exception).__name__}: {exception}{_where(exception)}")


@contextmanager
def reporting() -> Iterator[None]:
    """:func:`report` an exception raised in the block at once (before Lightning's exception hooks run), then
    let it through."""
    try:
        yield
    except BaseException as exception:
        report(exception)
        raise


def publish(cause: str) -> Optional[str]:
    """Publish ``cause`` as the job's failure cause unless one was published first; return the job's cause.

    Returns:
        The cause on the board (``cause`` if it was the first), or ``None`` when the store cannot be reached
        (it lives in global rank 0's process, which may be gone).
    """
    if _Board.store is None:
        return None
    try:
        published = _Board.store.compare_set(key("cause"), "", cause).decode()
        _acknowledge()
        return published
    except RuntimeError:
        return None


def _acknowledge() -> None:
    """Count this process among those that know the job's cause, for :func:`linger` (once per run)."""
    if not _Board.read:
        _Board.read = True
        _Board.store.add(key("read"), 1)


def published_cause(wait: timedelta = timedelta(0)) -> Optional[str]:
    """The job's published failure cause, waiting up to ``wait`` for one; ``None`` if there is none (yet).

    Raises:
        RuntimeError: if the store cannot be reached (global rank 0's process is gone).
    """
    if _Board.store is None:
        return None
    if wait:
        try:
            _Board.store.wait([key("cause")], wait)
        except RuntimeError:
            pass  # timed out, or the store is gone: `check` tells which
    if not _Board.store.check([key("cause")]):
        return None
    cause = _Board.store.get(key("cause")).decode()
    _acknowledge()
    return cause


def linger() -> None:
    """After a failure, wait until every process of the job has read its cause (a few seconds at most).

    The store lives in global rank 0's process, and Lightning's launcher kills every stage once one has exited:
    a failing process that exited at once could take the cause with it, or get the others killed before they
    read and named it.
    """
    if _Board.store is None or published_cause() is None:
        return
    deadline = time.monotonic() + _LINGER
    while _Board.store.add(key("read"), 0) < _Board.processes and time.monotonic() < deadline:
        time.sleep(0.05)


@contextmanager
def as_pipeline_failure(detail: Optional[Callable[[], str]] = None) -> Iterator[None]:
    """Turn a failed transfer or collective inside the block into a :class:`PipelineFailure` naming the cause.

    Args:
        detail: says what is known of the other stages when no cause was published (e.g. where each stage
            last was); by default the transport's error alone is named.

    Raises:
        PipelineFailure: with the published cause, or the transport's error (and ``detail``) when none was
            published.
    """
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PipelineFailure):
            raise
        try:
            cause = published_cause(_WAIT_FOR_CAUSE)
        except RuntimeError:
            cause = None
        if cause is None:
            more = f"; {detail()}" if detail is not None else ""
            raise PipelineFailure(f"{_Board.name}: another stage stopped responding ({error}){more}") from error
        raise PipelineFailure(f"{_Board.name} stopped because {cause}") from error


def stopped_because(cause: str) -> PipelineFailure:
    """The :class:`PipelineFailure` this stage raises when it stops because of the job's ``cause``."""
    if cause.startswith(f"{_Board.name} "):
        return PipelineFailure(cause)
    return PipelineFailure(f"{_Board.name} stopped because {cause}")


def _where(exception: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exception``'s traceback, without reading source files."""
    tb = exception.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"


def say(message: str) -> None:
    """Write ``message`` to this process's stderr at once (also when the process is about to end abruptly)."""
    try:
        sys.stderr.write(f"[{_Board.name}] {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
