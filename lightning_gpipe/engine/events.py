"""What one stage does during a step, as timestamped spans: the raw material of the pipeline callbacks.

A stage (:class:`lightning_gpipe.engine.model_chunk.ModelChunk`) and its transfers
(:class:`lightning_gpipe.engine.transfer.Link`) share a :class:`Recorder`. While it is disabled, a span costs one method
call that returns a shared no-op context. Once enabled (the callbacks in :mod:`lightning_gpipe.lightning.callbacks`
enable it for the training steps), every micro-batch's forward, recompute and backward, the last stage's loss, and every
wait on a transfer is recorded as a :class:`Span` of ``time.perf_counter()`` timestamps.

``perf_counter`` is ``CLOCK_MONOTONIC`` on Linux: the same clock for every process of one machine, so the
stages' spans line up on one time axis. Across machines the clocks are unrelated: the callbacks move another
node's spans onto global rank 0's clock by an offset measured once
(:mod:`lightning_gpipe.lightning.callbacks._pipeline`).
"""

import time
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_gpipe._torch import DispatchMode, tree_flatten
from lightning_gpipe.engine.microbatch import tensors
from lightning_gpipe.faults import Position

WORK = ("forward", "recompute", "backward", "weight", "loss", "optimizer")
"""Span kinds during which a stage computes (its busy time)."""

TRANSFER = ("send", "recv", "relay")
"""Span kinds during which a stage posts sends (``send``) or is blocked on a transfer (``recv``, and ``send``
for the final flush of pending sends), or shares the last stage's logged results (``relay``)."""

_OFF = nullcontext()


class Span(NamedTuple):
    """One interval of a stage's step.

    Attributes:
        kind: one of :data:`WORK` or :data:`TRANSFER`; ``"backward"`` is a micro-batch's backward, or only its
            input gradient when its weight gradient is deferred to a ``"weight"`` span; ``"loss"`` is the last
            stage's time between its backbone output and the drain (the user's head and loss, and their
            backward to the boundary); ``"optimizer"`` the optimizer step.
        micro_batch: index of the micro-batch (0-based), ``None`` for whole-step spans.
        start: ``time.perf_counter()`` seconds at the start.
        end: ``time.perf_counter()`` seconds at the end.
        input_bytes: forward and recompute spans that count memory: bytes of the micro-batch's input tensors,
            which the stage keeps until the micro-batch's backward.
        saved_bytes: the same spans: bytes autograd saved for the backward (activations), not counting
            parameters or the input; 0 for a checkpointed micro-batch's forward, which keeps none.
        model_chunk: the stage's model chunk (virtual stage) the span belongs to; 0 with one model chunk per stage.
    """

    kind: str
    micro_batch: int | None
    start: float
    end: float
    input_bytes: int = 0
    saved_bytes: int = 0
    model_chunk: int = 0


class Recorder:
    """Collects the :class:`Span` list of one stage while :attr:`enabled` (default ``False``).

    Memory is counted only while :attr:`memory` is also set (default ``False``): a Python hook per saved
    tensor costs a few percent of a step.
    """

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.enabled = False
        self.memory = False

    def span(self, kind: str, micro_batch: int | None = None, memory_of: tuple | None = None, model_chunk: int = 0):
        """A context manager that records a span of ``kind`` around its body, when enabled.

        Args:
            kind: the span's kind (see :class:`Span`).
            micro_batch: the micro-batch index, or ``None``.
            memory_of: ``(module, input)``: when :attr:`memory` is set, also count the input's bytes and the bytes
                autograd saves in the body, except ``module``'s parameters and the input (with
                ``torch.autograd.graph.saved_tensors_hooks``).
            model_chunk: the model chunk the span belongs to (default 0).
        """
        if not self.enabled:
            return _OFF
        return _Timing(self, kind, micro_batch, memory_of if self.memory else None, model_chunk)

    def add(self, kind: str, micro_batch: int | None, start: float, end: float, model_chunk: int = 0) -> None:
        """Record a span measured by the caller, when enabled (``model_chunk``: the model chunk it belongs to)."""
        if self.enabled:
            self.spans.append(Span(kind, micro_batch, start, end, model_chunk=model_chunk))

    def split_last(self, kind: str, at: float | None) -> None:
        """End the last span recorded at ``at`` (``None``: where it ends) and record the rest of it as a span of
        ``kind``, of the same micro-batch and model chunk. Nothing when disabled."""
        if not self.enabled:
            return
        last = self.spans[-1]
        at = last.end if at is None else min(max(at, last.start), last.end)
        self.spans[-1] = last._replace(end=at)
        self.spans.append(Span(kind, last.micro_batch, at, last.end, model_chunk=last.model_chunk))

    def take(self) -> list[Span]:
        """Return the spans recorded so far and start a new list."""
        spans, self.spans = self.spans, []
        return spans

    def for_model_chunk(self, model_chunk: int) -> "Recorder":
        """A recorder for model chunk ``model_chunk`` of this stage (virtual stages): its spans go to this recorder's
        list, marked with the model chunk; enabling this recorder enables it. Model chunk 0 is this recorder itself."""
        return self if model_chunk == 0 else _ModelChunkRecorder(self, model_chunk)


class _ModelChunkRecorder(Recorder):
    """The view of a stage's :class:`Recorder` that one model chunk records into (see
    :meth:`Recorder.for_model_chunk`)."""

    def __init__(self, parent: Recorder, model_chunk: int) -> None:  # no super().__init__(): the state is the parent's
        self.parent, self.model_chunk = parent, model_chunk

    enabled = property(lambda self: self.parent.enabled)
    memory = property(lambda self: self.parent.memory)
    spans = property(lambda self: self.parent.spans)

    def span(self, kind: str, micro_batch: int | None = None, memory_of: tuple | None = None, model_chunk: int = 0):
        return self.parent.span(kind, micro_batch, memory_of, self.model_chunk)

    def add(self, kind: str, micro_batch: int | None, start: float, end: float, model_chunk: int = 0) -> None:
        self.parent.add(kind, micro_batch, start, end, self.model_chunk)

    def take(self) -> list[Span]:
        return self.parent.take()


class SavedBytes:
    """Counts the bytes autograd saves for the backward inside a ``with`` block: each storage once, not ``exclude``'s.

    Uses ``torch.autograd.graph.saved_tensors_hooks``, so it sees exactly what the backward will need.

    Args:
        exclude: tensors whose storages are not counted (parameters, buffers, the block's input).

    Attributes:
        bytes: the count so far.
        storages: the counted storages so far, address -> bytes.
    """

    def __init__(self, exclude: Iterable[Tensor]) -> None:
        self.bytes = 0
        self.storages: dict[int, int] = {}
        self._seen = {t.untyped_storage().data_ptr() for t in exclude}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _same)

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.storages[storage.data_ptr()] = storage.nbytes()
            self.bytes += storage.nbytes()
        # Not ``tensor`` itself: a layer's output it saves (ReLU's) would then hold its own graph through the
        # graph's C++ node, a reference cycle Python's collector cannot see, and the graph would never be freed.
        return tensor.detach()


class PeakBytes(DispatchMode):
    """Counts the bytes of the tensor storages the operators inside a ``with`` block create, live now and at the peak.

    A ``TorchDispatchMode``: it sees every operator's outputs, the backward's included, on any device; a storage counts
    from the operator that creates it until it is freed. Memory a library keeps outside tensors (oneDNN's scratchpads)
    is not seen.

    Attributes:
        live: bytes of the counted storages alive now.
        peak: the largest ``live`` since the block began or the last :meth:`restart`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._storages: dict[int, tuple[weakref.ref, int]] = {}  # address -> (the storage, bytes)

    def restart(self) -> int:
        """Start a new peak from the bytes live now; returns them."""
        self.peak = self.live
        return self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and t.device.type != "meta":
                self._count(t.untyped_storage())
        self.peak = max(self.peak, self.live)
        return out

    def _count(self, storage) -> None:
        """Count ``storage`` if it is new (not a view's or an in-place result's; an address can be reused before the
        storage that had it is reported freed)."""
        key = storage.data_ptr()
        if not key or (key in self._storages and self._storages[key][0]() is storage):
            return
        self._free(key)
        ref = weakref.ref(storage, lambda ref: self._free(key, ref))
        self._storages[key] = (ref, storage.nbytes())
        self.live += storage.nbytes()

    def _free(self, key: int, ref: weakref.ref | None = None) -> None:
        if key in self._storages and (ref is None or self._storages[key][0] is ref):
            self.live -= self._storages.pop(key)[1]


def _same(tensor: Tensor) -> Tensor:
    return tensor


class _Timing:
    """An enabled span: times its body and, given ``memory_of``, counts the bytes kept and saved in it."""

    def __init__(
        self, recorder: Recorder, kind: str, micro_batch: int | None, memory_of: tuple | None, model_chunk: int
    ):
        self.recorder, self.kind, self.micro_batch, self.memory_of = recorder, kind, micro_batch, memory_of
        self.model_chunk = model_chunk
        self.input_bytes = 0
        self.saved: SavedBytes | None = None

    def __enter__(self) -> None:
        if self.memory_of is not None:
            module, value = self.memory_of
            inputs = tensors(value)
            self.input_bytes = sum(t.nbytes for t in inputs)
            self.saved = SavedBytes([*inputs, *module.parameters(), *module.buffers()]).__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        end = time.perf_counter()
        if self.saved is not None:
            self.saved.__exit__(*exc)
        saved = self.saved.bytes if self.saved is not None else 0
        self.recorder.spans.append(
            Span(self.kind, self.micro_batch, self.start, end, self.input_bytes, saved, self.model_chunk)
        )


@contextmanager
def gradient_times(tensor: Tensor) -> Iterator[list[float]]:
    """Inside the block, each time autograd computes ``tensor``'s gradient, ``time.perf_counter()`` is appended to the
    list the block gets."""
    times: list[float] = []
    hook = tensor.register_hook(lambda grad: times.append(time.perf_counter()))
    try:
        yield times
    finally:
        hook.remove()


def peak_activation_bytes(spans: Iterable[Span]) -> int:
    """Peak activation memory of one stage over one step, from its spans (bytes).

    A micro-batch's input is held from its forward to the end of its backward; the activations autograd
    saves are held from the forward (or, when checkpointed, the recompute) to the end of the backward, or of
    its deferred weight gradient (``weight``) when there is one; with several model chunks per stage, each
    model chunk's apart. Spans without byte counts add nothing. The same accounting serves measured and simulated steps.
    """
    released: dict[tuple[int | None, int], float] = {}  # when each micro-batch's last backward or W span ends
    for span in spans:
        if span.kind in ("backward", "weight"):
            key = (span.micro_batch, span.model_chunk)
            released[key] = max(span.end, released.get(key, span.end))
    held: dict[tuple[int | None, int], int] = {}
    changes = []
    for span in spans:
        if span.kind in ("forward", "recompute"):
            grow = span.saved_bytes + (span.input_bytes if span.kind == "forward" else 0)
            key = (span.micro_batch, span.model_chunk)
            held[key] = held.get(key, 0) + grow
            changes.append((span.start, grow))
    changes += [(released[micro], -total) for micro, total in held.items() if micro in released]
    peak = level = 0
    for _, change in sorted(changes):  # at equal times, frees (negative) come first
        level += change
        peak = max(peak, level)
    return peak


class TrackingRecorder(Recorder):
    """A :class:`Recorder` whose spans also move a stage's :class:`~lightning_gpipe.faults.watchdog.Position`.

    A stage and its link open a span for every forward, recompute, backward and transfer of a micro-batch,
    enabled or not, so the position follows the schedule at the cost of an attribute write per span. While the
    recorder is disabled, its :meth:`span` is the position's own
    (:meth:`~lightning_gpipe.faults.watchdog.Position.span`, installed on the instance when :attr:`enabled` is set):
    one call per span, no code of this module on the path every micro-batch takes.

    Args:
        position: the position the spans move.
    """

    def __init__(self, position: Position) -> None:
        self.position = position
        super().__init__()

    def __setattr__(self, name: str, value: Any) -> None:
        """Set an attribute; setting :attr:`enabled` also chooses :meth:`span` (``enabled`` stays a plain attribute:
        reading it runs no code)."""
        super().__setattr__(name, value)
        if name == "enabled" and value:
            self.__dict__.pop("span", None)  # this class's span: record, and move the position
        elif name == "enabled":
            self.__dict__["span"] = self.position.span

    def span(self, kind: str, micro_batch: int | None = None, memory_of: tuple | None = None, model_chunk: int = 0):
        """Move the position to ``kind`` of ``micro_batch``, then as :meth:`Recorder.span`."""
        self.position.move(kind, micro_batch)
        return super().span(kind, micro_batch, memory_of, model_chunk)
