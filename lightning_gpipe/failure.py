"""Naming the cause when one stage of the pipeline fails.

When a stage raises, its neighbours are blocked in a send or receive to it. The
failing process writes its error to the job's key-value store (the c10d store that
torch.distributed already shares) before it exits; its exit closes its
connections, so a neighbour's pending transfer fails, and that neighbour raises
:class:`PipelineFailure` carrying the first stage's error instead of a bare
"connection closed". The failure then cascades stage by stage, each process
exiting non-zero with the original cause named.
"""

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

_KEY = "lightning_gpipe/failure"
_WAIT_FOR_CAUSE = timedelta(seconds=10)


class PipelineFailure(RuntimeError):
    """Raised on a stage whose neighbour failed; the message names the failed stage and its error."""


class _Board:
    store: Optional[dist.Store] = None
    stage_index: int = 0


def attach(store: dist.Store, stage_index: int) -> None:
    """Use ``store`` (shared by all processes of the job) to publish failures of stage ``stage_index``."""
    _Board.store, _Board.stage_index = store, stage_index


def report(exception: BaseException) -> None:
    """Publish this stage's exception as the job's failure cause, unless a cause was published already.

    A :class:`PipelineFailure` is a consequence, not a cause, and is not published.
    """
    if _Board.store is None or isinstance(exception, PipelineFailure):
        return
    last = traceback.extract_tb(exception.__traceback__)[-1:] if exception.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    cause = f"stage {_Board.stage_index} failed with {type(exception).__name__}: {exception}{where}"
    try:
        _Board.store.compare_set(_KEY, "", cause)
    except RuntimeError:  # the store lives in rank 0's process, which may be gone already
        pass


@contextmanager
def as_pipeline_failure() -> Iterator[None]:
    """Turn a failed transfer or collective inside the block into a :class:`PipelineFailure` naming the cause.

    Raises:
        PipelineFailure: with the published cause, or the transport's error when none was published.
    """
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PipelineFailure):
            raise
        cause = _published_cause()
        if cause is None:
            raise PipelineFailure(f"stage {_Board.stage_index}: another stage stopped responding ({error})") from error
        raise PipelineFailure(f"stage {_Board.stage_index} stopped because {cause}") from error


def _published_cause() -> Optional[str]:
    if _Board.store is None:
        return None
    try:
        _Board.store.wait([_KEY], _WAIT_FOR_CAUSE)
        return _Board.store.get(_KEY).decode()
    except RuntimeError:
        return None
