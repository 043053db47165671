"""Where stashed skip tensors wait for their pop during a forward.

Without a pipeline, each thread has one plain :class:`SkipTracker`: a stash waits there until a later
layer pops it, so a skippable backbone runs on one device as it is (torchgpipe's thread-local tracker). A
pipeline stage runs each micro-batch's forward under its own tracker (:func:`tracking`), given the skip
tensors received from earlier stages; what is still stashed after the stage's layers ran is what goes on to
later stages.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor


class SkipTracker:
    """The skip tensors of one forward: stashed ones, and ones received from earlier stages.

    Args:
        received: tensors stashed on earlier stages for this forward's layers to pop, by key
            (``(namespace, name)``); none by default.
    """

    def __init__(self, received: dict[Any, Tensor] | None = None) -> None:
        self.received = dict(received or {})
        self.stashed: dict[Any, Tensor] = {}

    def save(self, key: Any, tensor: Tensor) -> None:
        """Keep ``tensor`` under ``key`` until it is popped (a newer stash of the key replaces it)."""
        self.stashed[key] = tensor

    def load(self, key: Any) -> Tensor:
        """Pop the tensor stashed (or received) under ``key``. A received tensor that is a leaf requiring grad (a
        training forward's, which receives its gradient and may be run again) is popped as a copy, which the layer
        may modify in place; its gradient flows to the leaf.

        Raises:
            RuntimeError: if nothing is stashed under ``key``.
        """
        if key in self.stashed:
            return self.stashed.pop(key)
        if key in self.received:
            tensor = self.received.pop(key)
            return tensor.clone() if tensor.is_leaf and tensor.requires_grad else tensor
        namespace, name = key
        where = "" if namespace is None else f" in namespace {namespace!r}"
        raise RuntimeError(
            f"pop({name!r}){where}: no earlier layer stashed it in this forward. Stash it in an earlier layer of the"
            " same backbone call (`yield stash(...)`), or isolate both layers in the same namespace."
        )


_current: ContextVar[SkipTracker | None] = ContextVar("lightning_gpipe_skip_tracker", default=None)
_plain = threading.local()


def current() -> SkipTracker:
    """The tracker of the running forward: a stage's micro-batch tracker, else this thread's plain one."""
    found = _current.get()
    if found is not None:
        return found
    if not hasattr(_plain, "tracker"):
        _plain.tracker = SkipTracker()
    return _plain.tracker


@contextmanager
def tracking(skips: SkipTracker) -> Iterator[SkipTracker]:
    """Make ``skips`` the :func:`current` tracker inside the block."""
    token = _current.set(skips)
    try:
        yield skips
    finally:
        _current.reset(token)
