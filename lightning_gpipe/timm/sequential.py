"""A timm model as the backbone contract: :func:`to_sequential`."""

from __future__ import annotations

from torch import nn

from lightning_gpipe.timm import selfcheck
from lightning_gpipe.timm.families import family_of


def to_sequential(model: nn.Module, check: bool = True) -> nn.Sequential:
    """The backbone of the timm ``model``: embedding -> one layer per block -> head, sharing its modules.

    Nothing is copied: each layer (a :class:`~lightning_gpipe.timm.layer.TimmLayer`) holds ``model``'s own modules
    and top-level parameters under their names in ``model`` (``backbone.0.cls_token`` is ``model.cls_token``,
    ``backbone.3.stages.1.blocks.0.conv_dw.weight`` is ``model.stages[1].blocks[0].conv_dw.weight``), so training the
    backbone trains ``model``. Which layers a model is cut into is its family's business
    (:mod:`lightning_gpipe.timm.families`). The backbone takes images ``(N, C, H, W)`` and returns what ``model``
    returns, the logits ``(N, num_classes)``: applied layer by layer it equals ``model(images)``.

    Args:
        model: a timm model of a supported family (:data:`~lightning_gpipe.timm.families.FAMILIES`), in training or
            evaluation mode, on any device.
        check: prove the cut on ``model`` first (default; :mod:`lightning_gpipe.timm.selfcheck`, two images, a few
            forwards). ``False`` skips it: for a model built on the meta device, or a cut you have proved yourself.

    Returns:
        The ``nn.Sequential`` of the layers.

    Raises:
        UnsupportedModelError: for a model of no supported family (naming the families), or an option its family
            does not cut (naming it).
        SelfCheckError: if the layers, applied one after the other, differ from ``model``'s own forward (naming the
            family and the first layer that differs).
        ValueError: if the layers leave a parameter or buffer of ``model`` out.
    """
    family = family_of(model)
    layers = family.layers(model)
    held = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in held]
    if missing:
        raise ValueError(
            f"The {family.name} family's layers leave {len(missing)} tensors of {type(model).__name__} out"
            f" ({', '.join(missing[:3])}...): cut it into an nn.Sequential yourself (docs/contract.md)."
        )
    if check:
        selfcheck.verify(model, layers, family.name)
    return nn.Sequential(*layers)
