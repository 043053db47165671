"""Activation offload: what a micro-batch's forward saves for its backward waits in host memory, not on the device.

PipeOffload (Wan et al., ICML 2025, arXiv:2503.01328) observes that in a pipeline most of a micro-batch's life on a
stage is spent waiting for its backward while other micro-batches compute, so its activations can go to host memory
meanwhile and come back just before its backward, the copies hidden behind the other micro-batches' compute. This is
our own, written for one model chunk with torch's ``torch.autograd.graph.saved_tensors_hooks``:

- Packing (:meth:`ActivationOffload.saving`): while a micro-batch's forward runs, each tensor autograd saves is held
  by a handle, except a parameter or a view of one (a linear layer's ``weight.t()``; kept by the model anyway) and a
  tensor under :data:`MIN_BYTES` (a copy's fixed cost outweighs it). Each distinct saved tensor is one handle.
- Moving (:meth:`ActivationOffload.keep`): once the forward has run, the handles whose storage the model chunk keeps
  anyway (the micro-batch's input, output and skip tensors) stay; the others are copied to pinned host memory on a
  side CUDA stream, and their device memory is released once the copy is done.
- Prefetching (:meth:`ActivationOffload.prefetch`): the schedule places each copy back (:func:`placement`): before
  the computing action that precedes the micro-batch's first action that backpropagates through it, so the copy
  overlaps that action's compute. A micro-batch whose forward is followed at once by its backward (the last
  micro-batch of fill-drain, 1F1B's last stage) is not offloaded: there is nothing to overlap with.
- Unpacking: the backward takes the device copy (waiting on the side stream for it), or, for a copy never prefetched,
  copies it back then. The handles belong to the autograd graph, so the device copies go with it: after the
  backward, or with the B/W split after W (W unpacks the same tensors again, :mod:`~lightning_gpipe.engine.weightgrad`).

Re-materialization: a checkpointed micro-batch's forward runs without autograd and saves nothing (its input is kept
by the model chunk), and its recompute's saved tensors are used at once by its backward, so neither is offloaded.

On a CPU the hooks, handles and prefetches run the same, but a handle keeps the tensor itself: there is no other
memory to move it to. Values are never changed, so a step with offload equals one without it, bit for bit.
"""

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import view_base
from lightning_gpipe.engine.actions import COMPUTE, Kind, Plan

MIN_BYTES = 1 << 20
"""The smallest saved tensor that is offloaded (bytes); smaller ones stay on the device."""


class _Saved:
    """One saved tensor of a micro-batch: on the device during its forward, in host memory after it, on the device
    again from its prefetch (``ready``: the side stream's event the copy back completes at)."""

    __slots__ = ("device", "host", "ready")

    def __init__(self, tensor: Tensor) -> None:
        self.device: Tensor | None = tensor
        self.host: Tensor | None = None
        self.ready: torch.cuda.Event | None = None


class ActivationOffload:
    """One model chunk's activation offload (see the module docstring): its hooks, the micro-batches in host memory
    and their prefetches.

    Args:
        device: the model chunk's device; on a CPU nothing is copied.
        min_bytes: the smallest saved tensor offloaded; ``None`` (default): :data:`MIN_BYTES`.
        counter: called with the bytes of each tensor moved to host memory (``None``, default: nothing).

    Attributes:
        planned: the micro-batches of the step whose forward offloads (:meth:`begin_step`).
        late: the saved tensors copied back at their unpack since the step began, not by a prefetch (0 when the
            schedule's prefetches cover every offloaded micro-batch).
    """

    def __init__(
        self, device: torch.device, min_bytes: int | None = None, counter: Callable[[int], None] | None = None
    ) -> None:
        self.device, self.counter = device, counter
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._held: dict[int, list[_Saved]] = {}  # by micro-batch: what waits in host memory for its prefetch
        self.planned, self.late = frozenset[int](), 0

    def begin_step(self, planned: frozenset[int]) -> None:
        """Start a step whose forwards of micro-batches ``planned`` offload (see :func:`placement`); forget what the
        last step left in host memory (nothing, unless it stopped before its backwards)."""
        self._held, self.planned, self.late = {}, planned, 0

    @contextmanager
    def saving(self) -> Iterator[dict[tuple, _Saved]]:
        """Run the block (a micro-batch's forward) with its saved tensors held by handles; yields them (filled as the
        block runs), for :meth:`keep`. A parameter is told by its type, a view of one by its base: under FSDP2 the
        parameters of a stage's layers are gathered only while each runs, so no set of storages made before the block
        holds them."""
        handles: dict[tuple, _Saved] = {}

        def pack(tensor: Tensor) -> Tensor | _Saved:
            small = tensor.numel() * tensor.element_size() < self.min_bytes
            if small or isinstance(tensor, nn.Parameter) or isinstance(view_base(tensor), nn.Parameter):
                return tensor.detach()  # not the tensor itself: a saved output would hold its own graph (a cycle)
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride())
            return handles.setdefault((*key, tensor.dtype), _Saved(tensor.detach()))

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield handles

    def keep(self, index: int, handles: dict[tuple, _Saved], kept: Iterable[Tensor]) -> None:
        """Move micro-batch ``index``'s saved tensors (``handles``, from :meth:`saving`) to host memory, except those
        sharing storage with ``kept`` (the tensors the model chunk holds until the backward anyway)."""
        stays = {t.untyped_storage().data_ptr() for t in kept}
        moving = [
            s for s in handles.values() if s.device is not None and s.device.untyped_storage().data_ptr() not in stays
        ]
        if self._stream is not None and moving:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward has written them
        moved = [s for s in moving if self._to_host(s)]
        if moved:
            self._held[index] = moved

    def _to_host(self, saved: _Saved) -> bool:
        """Copy one saved tensor to host memory and let its device memory go; ``False`` where it stays (a tensor
        with gaps or overlaps, whose copy would change its strides)."""
        tensor = saved.device
        assert tensor is not None  # moved once, at its forward
        if self._stream is None:  # a CPU: it is in host memory already
            saved.host = tensor
        else:
            with torch.cuda.stream(self._stream):
                host = torch.empty_like(tensor, device="cpu", pin_memory=True)
                if host.stride() != tensor.stride():
                    return False
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # its memory is reused only after the copy
            saved.host = host
        saved.device = None
        if self.counter is not None:
            self.counter(tensor.numel() * tensor.element_size())
        return True

    def prefetch(self, index: int) -> None:
        """Start copying micro-batch ``index``'s saved tensors back to the device, on the side stream (nothing if
        none is in host memory)."""
        held = self._held.pop(index, [])
        if self._stream is None:
            for saved in held:
                saved.device = saved.host
            return
        if not held:
            return
        with torch.cuda.stream(self._stream):
            for saved in held:
                assert saved.host is not None  # moved by `keep`
                saved.device = torch.empty_like(saved.host, device=self.device)
                saved.device.copy_(saved.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._stream)
        for saved in held:
            saved.ready = ready

    def _unpack(self, packed: Tensor | _Saved) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        if packed.device is None:  # not prefetched: copied back now, on the compute stream
            assert packed.host is not None  # moved by `keep`
            self.late += 1
            if self._stream is not None:  # after the copy to host memory, on the side stream
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            packed.device = packed.host.to(self.device)
        if packed.ready is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(packed.ready)
            packed.device.record_stream(current)  # made on the side stream, used and freed on this one
            packed.ready = None
        return packed.device


@dataclass(frozen=True)
class Placement:
    """Where a plan's offloads go: which micro-batches' forwards offload and which prefetch precedes which action.

    Attributes:
        offloaded: ``(model chunk, micro-batch)`` pairs whose forward moves its saved tensors to host memory.
        prefetch: action number -> the ``(model chunk, micro-batch)`` pairs to prefetch right before it.
    """

    offloaded: frozenset[tuple[int, int]]
    prefetch: dict[int, tuple[tuple[int, int], ...]]


@lru_cache(maxsize=64)
def placement(plan: Plan) -> Placement:
    """The offloads of ``plan``: each micro-batch's copy back goes before the computing action that precedes its first
    action after its forward that backpropagates through it (a loss, a recompute, a backward), so it overlaps that
    action's compute; a micro-batch whose forward is that action is not offloaded."""
    steps = [(n, a) for n, a in enumerate(plan.actions) if a.kind in COMPUTE and a.micro_batch is not None]
    forwards: dict[tuple[int, int], int] = {}
    offloaded: set[tuple[int, int]] = set()
    prefetch: dict[int, tuple[tuple[int, int], ...]] = {}
    for position, (_, action) in enumerate(steps):
        key = (action.model_chunk, cast(int, action.micro_batch))
        if action.kind is Kind.FORWARD:
            forwards[key] = position
        elif forwards.pop(key, position) < position - 1:  # the first action after the forward needing it
            offloaded.add(key)
            before = steps[position - 1][0]
            prefetch[before] = (*prefetch.get(before, ()), key)
    return Placement(frozenset(offloaded), prefetch)
