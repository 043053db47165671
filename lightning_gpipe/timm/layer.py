"""One backbone layer: some of a timm model's modules and parameters, held under their names in the model, and the
steps that run them.

Every layer of :func:`~lightning_gpipe.timm.to_sequential`'s backbone is a :class:`TimmLayer`. It registers the
model's own modules and top-level parameters (no copy: ``cls_token`` is the model's ``nn.Parameter``) under their
paths in the model, so its state-dict names are the model's behind the layer's index, and runs its :attr:`steps`:
a held module called on the tensor (:class:`Call`), or a method of the model's class (``_pos_embed``,
``forward_head``) run with the layer as ``self`` (:class:`Method`). Such a method reads the model's tensors and
modules through the layer, which holds them: every stage then reads its own copies, as a data-parallel engine that
replaces a stage's parameters (FSDP2) requires. Settings that are not tensors (``num_prefix_tokens``,
``global_pool``, ``drop_rate``) are read from the model; a tensor or module the layer does not hold is refused by
name rather than read from the model, where it may live on another stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import Any

from torch import Tensor, nn

from lightning_gpipe.engine import attach


class UnsupportedModelError(TypeError):
    """A timm model :func:`~lightning_gpipe.timm.to_sequential` cannot cut; the message names the class and why."""


Step = Callable[["TimmLayer", Tensor], Tensor]
"""One step of a layer: ``step(layer, x) -> x``."""


@dataclass(frozen=True)
class Call:
    """A step calling the module the layer holds under ``path`` (``"patch_embed"``, ``"blocks.3"``) on the tensor."""

    path: str

    def __call__(self, layer: TimmLayer, x: Tensor) -> Tensor:
        return layer.get_submodule(self.path)(x)


@dataclass(frozen=True)
class Method:
    """A step running the model's class's method ``name`` (``"_pos_embed"``, ``"forward_head"``) on the tensor, with
    the layer as ``self``; with ``first``, the first of the tuple it returns (Eva's ``_pos_embed`` gives ``(x,
    rotary embedding)``)."""

    name: str
    first: bool = False

    def __call__(self, layer: TimmLayer, x: Tensor) -> Tensor:
        value = getattr(type(layer.timm_model), self.name)(layer, x)
        return value[0] if self.first else value


class TimmLayer(nn.Module):
    """Some of a timm model's modules and top-level parameters, under their names in the model, run by ``steps``.

    Args:
        model: the timm model they belong to (kept as a plain attribute, not a submodule).
        label: what messages call the layer (``"embedding"``, ``"stages.1.blocks.0"``, ``"head"``).
        names: the dotted paths in ``model`` of the modules (``"stages.1.blocks.0"``) and top-level parameters
            (``"cls_token"``) the layer holds.
        steps: what the layer's forward runs on its input, in order (:class:`Call`, :class:`Method`, or a function
            ``step(layer, x) -> x``).
        entry: the path of the held module whose input is the layer's input in the model's own forward (what the
            self-check compares the previous layer's output with); ``None`` for the first layer.

    Attributes:
        timm_model: the whole model (not registered: its parameters are not this layer's).

    The layer takes and returns one tensor.
    """

    timm_model: nn.Module

    def __init__(
        self, model: nn.Module, label: str, names: Sequence[str], steps: Sequence[Step], entry: str | None = None
    ) -> None:
        super().__init__()
        self.__dict__["timm_model"] = model
        self.label, self.names, self.steps, self.entry = label, tuple(names), tuple(steps), entry
        parameters = dict(model.named_parameters(recurse=False))
        for name in self.names:
            if name in parameters:  # a top-level parameter of the model
                self.register_parameter(name, parameters[name])
            else:
                attach(self, name, model.get_submodule(name))

    def forward(self, x: Tensor) -> Tensor:
        """Run :attr:`steps` on ``x``."""
        for step in self.steps:
            x = step(self, x)
        return x

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("timm_model")
            if model is None or name.startswith("_"):
                raise
        value = getattr(model, name)
        if isinstance(value, (nn.Module, Tensor)):
            raise AttributeError(
                f"{type(model).__name__}'s `{name}` is not held by backbone layer {self.label!r} (it holds"
                f" {', '.join(self.names)}), whose steps read it: the family's cut misses it."
            )
        if isinstance(value, MethodType) and value.__self__ is model:
            return MethodType(value.__func__, self)  # the model's method, reading this layer's tensors
        return value

    def extra_repr(self) -> str:
        return f"label={self.label!r}"
