"""The activation vocabulary: values, their tensors, micro-batches of them, and the layers that map one to the next.

A :data:`Value` is what flows between backbone layers and stages: a Tensor, or a tuple whose
items are tensors (other items, e.g. a flag, are allowed in a backbone input and repeated
unchanged in every micro-batch). Tensors carry the batch in dim 0.

:func:`scatter` splits a mini-batch into micro-batches with :func:`torch.tensor_split` semantics,
so a batch that does not divide by M gives uneven micro-batches (the first ones one row
longer); :func:`gather` joins them back. :class:`MicroBatch` and :func:`current_micro_batch` tell a
layer which micro-batch it is running on. The names follow torchgpipe's ``microbatch`` module.

A :class:`Partition` holds a stage's backbone layers (one model chunk's) under their original names and applies them
to one value, checking each layer returns one (:meth:`Partition.run`); the user's call of the backbone goes through
it to the pipeline (:class:`PipelinedCall`). :mod:`lightning_gpipe.engine.partition` cuts a model into them.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, cast, overload

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children, version

Value = Tensor | tuple
"""A backbone activation: a Tensor or a tuple of tensors (and, in a backbone input, other items)."""


def tensors(value: Value) -> list[Tensor]:
    """The tensors of ``value``, in order (non-tensor items of a tuple left out)."""
    return [value] if isinstance(value, Tensor) else [x for x in value if isinstance(x, Tensor)]


def floats(value: Value) -> list[Tensor]:
    """The floating-point tensors of ``value``, in order: the ones that carry gradients between stages."""
    return [t for t in tensors(value) if t.is_floating_point()]


@overload
def leaves(value: Tensor, requires_grad: bool | None = True, device: torch.device | None = None) -> Tensor:
    """A Tensor's leaf (see the implementation below)."""


@overload
def leaves(value: tuple, requires_grad: bool | None = True, device: torch.device | None = None) -> tuple:
    """A tuple's leaves (see the implementation below)."""


def leaves(value: Value, requires_grad: bool | None = True, device: torch.device | None = None) -> Value:
    """``value`` with its tensors cut from their autograd history, as new leaves.

    Args:
        value: a Tensor or a tuple; non-tensor items are kept as they are.
        requires_grad: ``True`` (default): floating-point tensors require grad (they will receive
            gradients); ``False``: none does; ``None``: each keeps its own flag.
        device: ``None`` (default) shares the tensors' storage; a device makes copies there.
    """

    def leaf(t: Tensor) -> Tensor:
        flag = t.requires_grad if requires_grad is None else requires_grad
        fresh = t.detach() if device is None else t.detach().to(device, copy=True)
        return fresh.requires_grad_(flag and t.is_floating_point())

    if isinstance(value, Tensor):
        return leaf(value)
    return tuple(leaf(x) if isinstance(x, Tensor) else x for x in value)


def batch_size(value: Value) -> int:
    """Size of dim 0 shared by the tensors of ``value``.

    Raises:
        TypeError: if ``value`` holds no tensor.
        ValueError: if its tensors disagree on dim 0 or are 0-dimensional.
    """
    found = tensors(value) if isinstance(value, (Tensor, tuple, list)) else []
    if not found:
        raise TypeError(
            f"Expected a Tensor or a tuple holding tensors to split into micro-batches, got {_kind(value)}."
        )
    sizes = {t.shape[0] if t.dim() else None for t in found}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(t.shape) for t in found]
        raise ValueError(
            f"Every tensor passed to the backbone needs the same batch size in dim 0; got shapes {shapes}."
        )
    return cast(int, sizes.pop())  # not None, checked above


def scatter(value: Value, micro_batches: int) -> list[Value]:
    """Split ``value`` into ``min(micro_batches, batch size)`` micro-batches along dim 0.

    Args:
        value: a Tensor of shape (N, ...) or a tuple whose tensors all have N rows.
        micro_batches: M, the requested number of micro-batches (>= 1).

    Returns:
        A list of values of the same kind as ``value``; rows keep their order.

    Raises:
        TypeError, ValueError: as :func:`batch_size`.
    """
    micro_batches = min(micro_batches, batch_size(value))
    if isinstance(value, Tensor):
        return list(torch.tensor_split(value, micro_batches))
    columns = [torch.tensor_split(x, micro_batches) if isinstance(x, Tensor) else [x] * micro_batches for x in value]
    return [tuple(column[i] for column in columns) for i in range(micro_batches)]


def gather(parts: list[Value]) -> Value:
    """Concatenate micro-batches along dim 0; the inverse of :func:`scatter`.

    Non-tensor items are taken from the first micro-batch; a single micro-batch is returned as it is (no copy).
    """
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Tensor):
        return torch.cat(cast("list[Tensor]", parts))  # micro-batches of a tensor are tensors
    return tuple(
        torch.cat([part[i] for part in parts]) if isinstance(item, Tensor) else item for i, item in enumerate(first)
    )


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch a stage's layers are running on; see :func:`current_micro_batch`.

    Attributes:
        index: its position in the mini-batch, from 0.
        micro_batches: M, the micro-batches of this mini-batch (fewer than configured for a batch with fewer rows).
        recompute: ``True`` for the drain's re-materialization of a forward that already ran in the fill.
    """

    index: int
    micro_batches: int
    recompute: bool = False


_current: ContextVar[MicroBatch | None] = ContextVar("lightning_gpipe_micro_batch", default=None)


def current_micro_batch() -> MicroBatch | None:
    """The micro-batch the calling layer runs on inside a stage, or ``None`` outside a pipelined forward.

    For layers whose forward has effects beyond its output, such as batch norm's running statistics
    (:class:`lightning_gpipe.engine.batchnorm.DeferredBatchNorm`), which must happen once per mini-batch.
    """
    return _current.get()


@contextmanager
def running(micro: MicroBatch) -> Iterator[None]:
    """Make ``micro`` the :func:`current_micro_batch` inside the block."""
    token = _current.set(micro)
    try:
        yield
    finally:
        _current.reset(token)


def _kind(value: Any) -> str:
    return type(value).__name__


class PipelinedCall(Protocol):
    """What a call of a pipelined backbone goes through: the whole pipeline, not only this stage's layers.

    Installed in a :class:`Partition` as :attr:`Partition.backbone_call` by the strategy
    (:class:`lightning_gpipe.lightning.contract.BackboneCall`); the partition knows nothing else of the engine.
    """

    def __call__(self, value: Value) -> Value | None:
        """Run the pipeline on the backbone input ``value``; the backbone output on the last stage."""

    def forward_and_share(self, value: Value, fn: Callable[[Value], Any]) -> Any:
        """Run the pipeline without gradients and return ``fn`` of its output on every stage."""


class Partition(nn.Module):
    """The backbone layers of one stage, under their original names.

    :meth:`run` applies the local layers to one micro-batch. Calling the module (the user's
    ``self.backbone(x)``) goes through :attr:`backbone_call` when one is installed, else it is :meth:`run`.

    Args:
        layers: ordered mapping of original names (``"7"``) to layers.

    Attributes:
        backbone_call: the :class:`PipelinedCall` a call of the module goes through, or ``None`` (default).
        modifies_input: whether the layers modify their input's tensors in place (``nn.ReLU(inplace=True)`` first),
            found on the first run that keeps its input (see :meth:`run`); ``None`` until then.
    """

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.backbone_call: PipelinedCall | None = None
        self.modifies_input: bool | None = None

    def forward(self, value: Value) -> Value | None:
        """Run the pipeline on the backbone input ``value`` if one is installed, else the local layers."""
        return self.backbone_call(value) if self.backbone_call is not None else self.run(value)

    def run(self, value: Value, kept: bool = False) -> Value:
        """Apply the local layers in order to one micro-batch.

        Args:
            value: the micro-batch.
            kept: whether the caller keeps ``value`` past the run and needs it unchanged (a training forward's input,
                a leaf that receives its gradient and may be run again to re-materialize; a profiled layer's input,
                run again). The layers then run on copies of its tensors if they modify their input in place, so
                ``value`` stays as it was, a leaf of autograd (a copy's backward passes the gradient on unchanged:
                exact). Whether they do is found on the first such run, which always runs on copies: from the
                copies' version counters. ``False`` (default): the layers run on ``value`` itself.

        Raises:
            TypeError: if a layer returns anything but a Tensor or a tuple of Tensors.
            ValueError: if a layer returns a 0-dimensional tensor (activations carry the batch in dim 0).
            RuntimeError: if, with ``kept``, the layers modified ``value`` in place although its first run did not.
        """
        if not kept:
            return self._apply_layers(value)
        if self.modifies_input is not False:
            copies = _copies(value)
            output = self._apply_layers(copies)
            self.modifies_input = self.modifies_input or any(version(t) for t in tensors(copies))
            return output
        before = [version(t) for t in tensors(value)]
        output = self._apply_layers(value)
        if before != [version(t) for t in tensors(value)]:
            self.modifies_input = True
            raise RuntimeError(
                f"Backbone layers {', '.join(children(self))} modified their input in place on this micro-batch,"
                " though not on their first one, so the input they were given changed. Make the in-place operation"
                " unconditional (or out of place, e.g. `inplace=False`)."
            )
        return output

    def _apply_layers(self, value: Value) -> Value:
        for name, layer in children(self).items():
            assert layer is not None  # a backbone's layers are modules
            value = layer(value)
            if not _is_activation(value):
                raise TypeError(
                    f"Backbone layer {name} ({type(layer).__name__}) returned {_describe(value)}; layers of a"
                    " pipelined backbone must return a Tensor or a tuple of Tensors."
                )
            scalars = [i for i, t in enumerate(value if isinstance(value, tuple) else (value,)) if t.dim() == 0]
            if scalars:
                at = f" at position {scalars[0]} of its tuple" if isinstance(value, tuple) else ""
                raise ValueError(
                    f"Backbone layer {name} ({type(layer).__name__}) returned a 0-dimensional tensor{at}; activations"
                    " carry the batch in dim 0, so every tensor a backbone layer returns needs one row per sample."
                    " Keep the batch dimension (e.g. a per-sample value of shape (N,) or (N, 1)), or compute the"
                    " scalar after the backbone, in the head or the loss."
                )
        return value


def _copies(value: Value) -> Value:
    """``value`` with each tensor replaced by a copy (``clone()``: in autograd's graph, its gradient flows to the
    original)."""
    if isinstance(value, Tensor):
        return value.clone()
    return tuple(x.clone() if isinstance(x, Tensor) else x for x in value)


def _is_activation(value: object) -> bool:
    if isinstance(value, Tensor):
        return True
    return isinstance(value, tuple) and len(value) > 0 and all(isinstance(x, Tensor) for x in value)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(x).__name__ for x in value)})"
    return f"a {type(value).__name__}"
