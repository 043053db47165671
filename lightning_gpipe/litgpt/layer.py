"""One backbone layer: some of a litgpt ``GPT``'s modules, held under their paths in the model.

Every layer of :func:`~lightning_gpipe.litgpt.to_sequential`'s backbone is a :class:`LitLayer`. It registers the
model's own modules (no copy) under their dotted paths, so its state-dict names are litgpt's (those of a
``lit_model.pth``), and gives its tensors their values when a stage materialises it: read from a checkpoint
(:attr:`LitLayer.weights`, e.g. :class:`~lightning_gpipe.litgpt.checkpoint.LitCheckpoint`), else initialised as the
model's modules initialise themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_gpipe._torch import RESET_METHODS
from lightning_gpipe.engine import attach

try:
    from litgpt.model import GPT
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError('lightning_gpipe.litgpt needs litgpt: pip install "lightning-gpipe[litgpt]"') from error


class LitLayer(nn.Module):
    """One backbone layer: some of a litgpt ``GPT``'s modules, held under their paths in the model.

    Subclasses implement ``forward`` on tensors only. The model itself is kept as a plain attribute (not a
    submodule), so the layer's state-dict names are exactly the model's names of the modules it holds
    (``transformer.h.2.attn.qkv.weight``).

    Args:
        model: the ``litgpt.model.GPT`` the modules belong to.
        paths: the dotted paths of the modules in ``model`` (``"transformer.h.2"``), all registered in this layer.

    Attributes:
        gpt: the whole model (not registered: its parameters are not this layer's).
        paths: the paths given.
        weights: where :meth:`reset_parameters` reads this layer's tensors from, or ``None`` to initialise them. An
            object with ``load(names, device) -> {name: tensor}`` (:class:`~lightning_gpipe.litgpt.LitCheckpoint`).
    """

    gpt: GPT  # a plain attribute, in the instance's __dict__ (see __init__)

    def __init__(self, model: GPT, paths: Sequence[str]) -> None:
        super().__init__()
        self.__dict__["gpt"] = model
        self.paths = tuple(paths)
        self.weights: Any | None = None
        for path in self.paths:
            attach(self, path, model.get_submodule(path))

    @property
    def config(self) -> Any:
        """The model's ``litgpt.Config``."""
        return self.gpt.config

    def part(self, path: str) -> nn.Module:
        """The module held under ``path``."""
        return self.get_submodule(path)

    def load_weights(self) -> None:
        """Copy this layer's tensors from :attr:`weights`, reading only this layer's names.

        Raises:
            KeyError: if the checkpoint lacks one of them (naming it and the checkpoint).
            ValueError: if a tensor's shape differs from the checkpoint's (naming it and both shapes).
        """
        state = self.state_dict(keep_vars=True)
        if not state:
            return
        device = next(iter(state.values())).device
        assert self.weights is not None
        loaded = self.weights.load(list(state), device)
        with torch.no_grad():
            for name, tensor in state.items():
                if loaded[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name} is {tuple(loaded[name].shape)} in {self.weights} but {tuple(tensor.shape)} in the"
                        " model: the checkpoint is of another config."
                    )
                tensor.copy_(loaded[name])

    def reset_parameters(self) -> None:
        """Give this layer's tensors their values, in place, once a stage has allocated them: those of
        :attr:`weights` (:meth:`load_weights`), else as litgpt's modules initialise themselves (their own reset methods,
        called before this one by :func:`lightning_gpipe.engine.materialize`; a module with none, such as a
        mixture of experts' grouped router, by the model's ``_init_weights``, its buffers zero as litgpt creates them).

        Raises:
            KeyError, ValueError: see :meth:`load_weights`.
        """
        if self.weights is not None:
            self.load_weights()
            return
        for module in self.modules():
            if module is self or any(hasattr(module, name) for name in RESET_METHODS):
                continue
            for buffer in module.buffers(recurse=False):
                buffer.zero_()
            if any(True for _ in module.parameters(recurse=False)):
                self.gpt._init_weights(module)


def lit_name(layer_name: str) -> str:
    """litgpt's name of a backbone state-dict entry: ``"3.transformer.h.2.attn.qkv.weight"`` (relative to the
    backbone) to ``"transformer.h.2.attn.qkv.weight"``."""
    return layer_name.split(".", 1)[1]
