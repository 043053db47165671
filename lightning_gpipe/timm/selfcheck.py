"""The self-check: :func:`~lightning_gpipe.timm.to_sequential`'s layers, applied one after the other, must compute
what the model's own forward computes, before any step trains them.

A family names a model's pieces from its structure, and a model may do more in its ``forward`` than its family says
(an option, a subclass). So the cut is proved on the model itself, on a probe of two random images at the model's
input size (its patch embedding's ``img_size``, else 32 pixels): in evaluation mode, and in training mode with the
random generator seeded alike for both sides (dropout and stochastic depth draw the same masks when both apply them
in the same order). Each layer's output is compared with what the model's own forward hands the module that
starts the next layer (a forward pre-hook records it), and the last with the model's output, so a failure names the
first layer that differs. Nothing of the model changes: its modes, its buffers (batch norm's running statistics) and
the random generator's state are restored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe.timm.layer import TimmLayer, UnsupportedModelError

TOLERANCE = 1e-5
"""The largest difference allowed, relative to the largest absolute value of the model's tensor (at least 1)."""


class SelfCheckError(UnsupportedModelError):
    """A timm model whose layers, applied one after the other, do not compute its own forward (or fail where it
    runs); the message names the family and the first layer that differs."""


def probe(model: nn.Module) -> Tensor:
    """Two random images ``(2, C, S, S)`` for ``model``: ``C`` its first convolution's input channels, ``S`` its
    patch embedding's ``img_size`` (the first module with one), else 32."""
    convolution = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    channels = 3 if convolution is None else convolution.in_channels
    size: Any = next((m.img_size for m in model.modules() if getattr(m, "img_size", None) is not None), 32)
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    return torch.randn(2, channels, height, width, generator=torch.Generator().manual_seed(0))


@contextmanager
def _unchanged(model: nn.Module, layers: list[TimmLayer]) -> Iterator[None]:
    """Restore the modes of ``model`` and ``layers``, ``model``'s buffers and the random generator afterwards."""
    modes = [(m, m.training) for m in [*model.modules(), *(m for layer in layers for m in layer.modules())]]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            yield
        finally:
            for module, training in modes:
                module.training = training
            for buffer, value in buffers:
                buffer.copy_(value)


def _expected(model: nn.Module, layers: list[TimmLayer], x: Tensor) -> list[Tensor | None]:
    """What the model's own forward hands each layer's :attr:`~TimmLayer.entry` module, then its output."""
    received: list[Tensor | None] = [None] * (len(layers) - 1)

    def hook(index: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple) -> None:
            if received[index] is None and args:
                received[index] = args[0]

        return record

    entries = [model.get_submodule(layer.entry) for layer in layers[1:] if layer.entry is not None]
    handles = [module.register_forward_pre_hook(hook(i)) for i, module in enumerate(entries)]
    try:
        output = model(x)
    finally:
        for handle in handles:
            handle.remove()
    return [*received, output]


def _difference(ours: Tensor, theirs: Tensor | None) -> float:
    if theirs is None or not isinstance(ours, Tensor) or ours.shape != theirs.shape:
        return float("inf")
    scale = max(1.0, theirs.abs().max().item())
    return (ours.float() - theirs.float()).abs().max().item() / scale


def _first_difference(model: nn.Module, layers: list[TimmLayer], x: Tensor, family: str) -> tuple[int, float] | None:
    """``None`` if every layer's output equals the model's, else ``(the first layer that differs, difference)``."""
    torch.manual_seed(0)
    try:
        expected = _expected(model, layers, x)
    except Exception as error:
        raise SelfCheckError(
            f"lightning_gpipe.timm could not check how it cuts {type(model).__name__} ({family}): its own forward"
            f" fails on two images of {tuple(x.shape[1:])} with {type(error).__name__}: {error}. Pass"
            " `check=False` only for a model you have verified yourself."
        ) from error
    torch.manual_seed(0)
    for index, layer in enumerate(layers):
        try:
            x = layer(x)
        except Exception as error:
            raise SelfCheckError(
                f"{type(model).__name__} ({family}) is not cut into backbone layers correctly: layer {index}"
                f" ({layer.label}) fails with {type(error).__name__}: {error}, where the model's own forward runs."
            ) from error
        difference = _difference(x, expected[index])
        if not difference <= TOLERANCE:
            return index, difference
    return None


def verify(model: nn.Module, layers: list[TimmLayer], family: str) -> None:
    """Prove that ``layers`` (the family's cut of ``model``) compute ``model``'s own forward (see the module).

    Args:
        model: the timm model, on any device (not on the meta device).
        layers: its backbone layers.
        family: the family's name, for messages.

    Raises:
        SelfCheckError: naming the class, the family and the first layer whose output differs (or that fails), or
            for a model on the meta device (which cannot run: pass ``check=False`` to ``to_sequential``).
    """
    name = type(model).__name__
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise SelfCheckError(
            f"lightning_gpipe.timm cannot check how it cuts {name}: the model is on the meta device. Check it once"
            " on a materialised model, then pass `check=False`."
        )
    device = next(model.parameters()).device
    x = probe(model).to(device)
    with _unchanged(model, layers):
        for mode, training in (("in evaluation mode", False), ("in training mode (seeded alike)", True)):
            model.train(training)
            for layer in layers:
                layer.train(training)
            found = _first_difference(model, layers, x, family)
            if found is not None:
                index, difference = found
                raise SelfCheckError(
                    f"{name} ({family}) is not cut into backbone layers correctly: layer {index}"
                    f" ({layers[index].label}) differs from the model's own forward by {difference:.3g} (relative;"
                    f" allowed {TOLERANCE:g}) {mode}, on two images of {tuple(x.shape[1:])}. The model computes"
                    " something its family's cut does not, so lightning_gpipe.timm refuses it rather than train"
                    " another model: cut it into an nn.Sequential yourself (docs/contract.md)."
                )
