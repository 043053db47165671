"""One backbone layer: some of a Hugging Face model's modules, held under their paths in the model.

Every layer of :func:`~lightning_gpipe.hf.to_sequential`'s backbone is an :class:`HFLayer`. It registers the model's
own modules (no copy) under their dotted paths, so its state-dict names are the model's, and it gives its tensors
their values when a stage materialises it: read from a checkpoint (:attr:`HFLayer.weights`), else initialised as
the model initialises new weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_gpipe._torch import RESET_METHODS
from lightning_gpipe.engine import attach

try:
    from transformers import PreTrainedModel
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


class UnsupportedModelError(TypeError):
    """A model the adapter cannot cut into backbone layers; the message names the class and why."""


class HFLayer(nn.Module):
    """One backbone layer: some of a Hugging Face model's modules, held under their paths in the model.

    Subclasses implement ``forward`` on tensors only. The model itself is kept as a plain attribute (not a
    submodule), so the layer's state-dict names are exactly the model's names of the modules it holds.

    Args:
        model: the ``PreTrainedModel`` the modules belong to.
        paths: the dotted paths of the modules in ``model`` (``"model.layers.2"``), all registered in this layer.

    Attributes:
        hf_model: the whole model (not registered: its parameters are not this layer's).
        paths: the paths given.
        weights: where :meth:`reset_parameters` reads this layer's tensors from, or ``None`` to initialise them as
            the model initialises new weights (its ``_init_weights``). An object with ``load(names, device) ->
            {name: tensor}`` (e.g. :class:`~lightning_gpipe.hf.weights.SafetensorsWeights`) and optionally
            ``provides(name) -> bool``; without ``provides`` it must load every name of the layer.
        extra_init: called on each module :meth:`reset_parameters` initialises, after the model's ``_init_weights``
            (e.g. ``peft``'s own initialisation of LoRA adapters, see :mod:`lightning_gpipe.hf.lora`); ``None``
            (default) for none.
    """

    # plain attributes, in the instance's __dict__ (see __init__)
    hf_model: PreTrainedModel
    extra_init: Callable[[nn.Module], None] | None
    _skipped_resets: list[tuple[nn.Module, str]]

    def __init__(self, model: PreTrainedModel, paths: Sequence[str]) -> None:
        super().__init__()
        self.__dict__["hf_model"] = model
        self.__dict__["_skipped_resets"] = []
        self.__dict__["extra_init"] = None
        self.paths = tuple(paths)
        self.weights = None
        for path in self.paths:
            attach(self, path, model.get_submodule(path))

    @property
    def weights(self) -> Any | None:
        """Where :meth:`reset_parameters` reads this layer's tensors from, or ``None`` (see the class)."""
        return self.__dict__.get("_weights")

    @weights.setter
    def weights(self, weights: Any | None) -> None:
        # with weights, the inner modules whose tensors all come from the checkpoint skip their own reset when
        # materialised (children are reset before this layer): a random init of tensors about to be replaced would
        # make the whole layer resident once more, and cost its time; this layer's reset_parameters undoes it
        self.__dict__["_weights"] = weights
        self._restore_resets()
        if weights is None:
            return
        provided = {id(t) for t in self._provided().values()}
        for module in self.modules():
            tensors = [*module.parameters(), *module.buffers()]
            if module is self or not tensors or not all(id(t) in provided for t in tensors):
                continue
            for name in RESET_METHODS:
                if hasattr(type(module), name):
                    module.__dict__[name] = _loaded_from_checkpoint
                    self._skipped_resets.append((module, name))

    def _restore_resets(self) -> None:
        for module, name in self.__dict__["_skipped_resets"]:
            module.__dict__.pop(name, None)
        self._skipped_resets.clear()

    def _provided(self) -> dict[str, torch.Tensor]:
        """This layer's persistent tensors that :attr:`weights` gives, by name."""
        if self.weights is None:
            return {}
        persistent = self.state_dict(keep_vars=True)
        provides: Callable[[str], bool] | None = getattr(self.weights, "provides", None)
        return {name: t for name, t in persistent.items() if provides is None or provides(name)}

    @property
    def config(self) -> Any:
        """The model's configuration."""
        return self.hf_model.config

    def part(self, path: str) -> nn.Module:
        """The module held under ``path``."""
        return self.get_submodule(path)

    def reset_parameters(self) -> None:
        """Give this layer's parameters and buffers their values, in place: the tensors :attr:`weights` provides (a
        checkpoint's, read for this layer's names only), the others as the model initialises new weights (then
        :attr:`extra_init`).

        Called by :func:`lightning_gpipe.engine.partition.materialize` for a model built on the meta device (each stage
        initialises or loads only its own layers). Buffers that no checkpoint holds (rotary frequencies, BERT's
        position ids) are recomputed by the model's ``_init_weights``.

        Raises:
            KeyError: if :attr:`weights` lacks a name it should provide (naming it and the checkpoint).
        """
        provided = self._provided()
        loaded = {id(t) for t in provided.values()}
        for module in _post_order(self):
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if own and all(id(t) in loaded for t in own):
                continue  # everything of it comes from the checkpoint
            for tensor in [module, *own]:
                if getattr(tensor, "_is_hf_initialized", False):
                    tensor._is_hf_initialized = False  # type: ignore[attr-defined]  # transformers' flag
            with torch.no_grad():
                self.hf_model._init_weights(module)
                if self.extra_init is not None:
                    self.extra_init(module)
        if provided:
            device = next(iter(provided.values())).device
            for tensor in provided.values():  # free this layer's memory first: a stage peaks at its own size
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
            assert self.weights is not None  # it provided them
            for name, tensor in provided.items():
                if tensor.numel() == 0:  # a name sharing a tensor already read is skipped
                    tensor.data = self.weights.load([name], device=device)[name].to(tensor.dtype)
        self._restore_resets()  # the model's modules as they were


def _loaded_from_checkpoint() -> None:
    """Stands for the ``reset_parameters`` of a module whose tensors its :class:`HFLayer` reads from a checkpoint."""


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Each submodule once, children before their parents (as ``nn.Module.apply`` and the model's init go)."""
    seen: set[int] = set()

    def visit(node: nn.Module) -> Iterator[nn.Module]:
        for child in node.children():
            if id(child) not in seen:
                yield from visit(child)
        if id(node) not in seen:
            seen.add(id(node))
            yield node

    yield from visit(module)


def hf_name(layer_name: str) -> str:
    """The model's name of a backbone state-dict entry: ``"3.model.layers.2.mlp.up_proj.weight"`` (relative to the
    backbone) to ``"model.layers.2.mlp.up_proj.weight"``."""
    return layer_name.split(".", 1)[1]
