"""Which layers each timm architecture is cut into: the :class:`Family` that takes a model, and the families known.

Every family cuts alike: the **embedding** (the model's top-level parameters, ``cls_token`` and ``pos_embed``, with
every child before the blocks: a patch embedding with position embedding, position and patch dropout, pre-norm, or a
convolutional stem), then **one layer per block** of the trunk (``blocks``, ``stages``, ``layers``, ``layer1`` to
``layer4``, ``s1`` to ``s4``; a stage that only runs its children in order, an ``nn.Sequential`` included, is opened
into its children, and a child without tensors, such as an ``nn.Identity`` downsample, joins the block after it),
then the **head** (every child after the trunk: the final norm or convolution ``forward_features`` ends with, then
the model's own ``forward_head``: pooling, dropout and classifier). What differs between families is named in
:data:`FAMILIES`: the trunk's children, what the embedding runs where it is not each child in order, the head's
part of ``forward_features``, and what a block takes besides the tensor (Eva's rotary embedding). Every cut is proved
against the model's own forward before it is used (:mod:`lightning_gpipe.timm.selfcheck`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.timm.layer import Call, Method, Step, TimmLayer, UnsupportedModelError


@dataclass(frozen=True)
class EvaBlock:
    """Eva's block at ``path``, called with the rotary embedding of the patch grid (from the ``rope`` the layer
    holds, as ``Eva._pos_embed`` computes it for every block), or ``None`` for a model without one."""

    path: str

    def __call__(self, layer: TimmLayer, x: Tensor) -> Tensor:
        rope = layer.rope  # held, or the model's None
        if rope is not None:
            grid = cast(Any, layer.timm_model).patch_embed.grid_size
            rope = rope.get_embed() if hasattr(rope, "feat_shape") else rope.get_embed(shape=grid)
        return layer.get_submodule(self.path)(x, rope=rope)


def beit_tokens(layer: TimmLayer, x: Tensor) -> Tensor:
    """BEiT's class token and position embedding on the patch embeddings ``(N, P, C)``, as ``Beit.forward_features``
    adds them (it has no method for it): ``(N, 1 + P, C)``."""
    x = torch.cat((layer.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
    return x if layer.pos_embed is None else x + layer.pos_embed


def _beit_reason(model: Any) -> str | None:
    if model.rel_pos_bias is not None:
        return "a relative position bias shared by every block (use_shared_rel_pos_bias=True) is not supported"
    return None


def _eva_reason(model: Any) -> str | None:
    if model.rope is None:
        return None
    if getattr(model, "rope_mixed", False):
        return "a rotary embedding per depth (rope_mixed) is not supported"
    if model.dynamic_img_size or model.patch_drop is not None:
        return "a rotary embedding with dynamic_img_size or patch dropout (it varies per image) is not supported"
    return None


@dataclass(frozen=True)
class Family:
    """How one timm architecture is cut into backbone layers (see the module docstring).

    Attributes:
        name: what messages call it (``"ViT/DeiT"``).
        classes: the timm classes it takes, by name (a subclass of one is taken too, and proved like it).
        trunk: the model's children that hold the blocks, in order (``("layer1", ..., "layer4")``).
        features: the children after the trunk that ``forward_features`` runs before ``forward_head``, in order.
        embed: the embedding layer's steps; empty (default): each child before the trunk, called in order.
        stages: the classes of trunk modules whose forward runs their children in order, opened into them.
        block: the step of the block at a path. Default: call it on the tensor.
        with_blocks: children of the model every block's layer holds too (Eva's ``rope``: buffers only).
        reason: why a model of the family cannot be cut (an option the cut does not follow), or ``None``.
    """

    name: str
    classes: tuple[str, ...]
    trunk: tuple[str, ...]
    features: tuple[str, ...]
    embed: tuple[Step, ...] = ()
    stages: tuple[str, ...] = ()
    block: Callable[[str], Step] = Call
    with_blocks: tuple[str, ...] = ()
    reason: Callable[[Any], str | None] | None = None

    def layers(self, model: nn.Module) -> list[TimmLayer]:
        """``model`` cut into the embedding, one layer per block (children without tensors joining the next) and
        the head, holding its modules and parameters (no copy).

        Raises:
            UnsupportedModelError: if the model lacks a child the family names, or its :attr:`reason` refuses it.
        """
        names = list(dict(model.named_children()))
        missing = [name for name in (*self.trunk, *self.features) if name not in names]
        reason = f"it has no {missing}" if missing else self.reason(model) if self.reason else None
        if reason is not None:
            raise UnsupportedModelError(
                f"lightning_gpipe.timm cannot cut {type(model).__name__} ({self.name}): {reason}."
            )
        first, last = names.index(self.trunk[0]), names.index(self.trunk[-1])
        before, after = names[:first], names[last + 1 :]
        embed = self.embed or tuple(Call(name) for name in before)
        top = [name for name, _ in model.named_parameters(recurse=False)]
        layers = [TimmLayer(model, "embedding", [*top, *before], embed)]
        shared = [name for name in self.with_blocks if name in names]
        for group in _groups(model, [p for name in self.trunk for p in self._opened(model, name)]):
            steps = [self.block(path) for path in group]
            layers.append(TimmLayer(model, ", ".join(group), [*group, *shared], steps, entry=group[0]))
        head: list[Step] = [*(Call(name) for name in self.features), Method("forward_head")]
        layers.append(TimmLayer(model, "head", after, head, entry=after[0]))
        return layers

    def _opened(self, model: nn.Module, path: str) -> list[str]:
        """The paths of the blocks under ``path``: an ``nn.Sequential``'s (or ``nn.ModuleList``'s) blocks are its
        children's, a stage's (a class of :attr:`stages`) are its children, those of its ``blocks`` opened; any
        other module is one block."""
        module = model.get_submodule(path)
        names = [name for name, _ in module.named_children()]
        if type(module).__name__ in self.stages:
            return [
                p for n in names for p in (self._opened(model, f"{path}.{n}") if n == "blocks" else [f"{path}.{n}"])
            ]
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            return [p for name in names for p in self._opened(model, f"{path}.{name}")]
        return [path]


def _groups(model: nn.Module, paths: list[str]) -> list[list[str]]:
    """``paths`` in groups of one block, each with the modules without tensors just before it (the last group takes
    those at the end)."""
    groups: list[list[str]] = [[]]
    for path in paths:
        groups[-1].append(path)
        module = model.get_submodule(path)
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            groups.append([])
    if not groups[-1]:
        groups.pop()
    elif len(groups) > 1:
        groups[-2] += groups.pop()
    return groups


FAMILIES: list[Family] = [
    Family(
        "ViT/DeiT",
        ("VisionTransformer", "VisionTransformerDistilled"),
        ("blocks",),
        ("norm",),
        embed=(Call("patch_embed"), Method("_pos_embed"), Call("patch_drop"), Call("norm_pre")),
    ),
    Family(
        "BEiT",
        ("Beit",),
        ("blocks",),
        ("norm",),
        embed=(Call("patch_embed"), beit_tokens, Call("pos_drop")),
        reason=_beit_reason,
    ),
    Family(
        "EVA",
        ("Eva",),
        ("blocks",),
        ("norm",),
        embed=(Call("patch_embed"), Method("_pos_embed", first=True), Call("norm_pre")),
        block=EvaBlock,
        with_blocks=("rope",),
        reason=_eva_reason,
    ),
    Family("Swin", ("SwinTransformer",), ("layers",), ("norm",), stages=("SwinTransformerStage",)),
    Family("ConvNeXt", ("ConvNeXt",), ("stages",), ("norm_pre",), stages=("ConvNeXtStage",)),
    Family("ResNet/ResNeXt", ("ResNet",), ("layer1", "layer2", "layer3", "layer4"), ()),
    Family("EfficientNet", ("EfficientNet",), ("blocks",), ("conv_head", "bn2")),
    Family("RegNet", ("RegNet",), ("s1", "s2", "s3", "s4"), ("final_conv",), stages=("RegStage",)),
    Family("MLP-Mixer", ("MlpMixer",), ("blocks",), ("norm",)),
]
"""The families :func:`family_of` knows, each with the timm classes it takes: ViT and DeiT (``VisionTransformer``,
``VisionTransformerDistilled``), BEiT (``Beit``), EVA (``Eva``: EVA-02's rotary embedding too), Swin
(``SwinTransformer``), ConvNeXt, ResNet and ResNeXt (``ResNet``), EfficientNet, RegNet and MLP-Mixer (``MlpMixer``)."""


def supported() -> str:
    """The families and their classes, for messages: ``"ViT/DeiT (VisionTransformer, ...), ..."``."""
    return ", ".join(f"{family.name} ({', '.join(family.classes)})" for family in FAMILIES)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` that takes ``model``: the first of :data:`FAMILIES` naming its timm class (or a timm
    class it derives from).

    Raises:
        UnsupportedModelError: if none does, naming the class and the families supported.
    """
    timm_classes = [c.__name__ for c in type(model).__mro__ if c.__module__.startswith("timm.")]
    for name in timm_classes:
        for family in FAMILIES:
            if name in family.classes:
                return family
    raise UnsupportedModelError(
        f"lightning_gpipe.timm cannot cut {type(model).__name__}: it is none of the supported timm families,"
        f" {supported()}. Cut it into an nn.Sequential yourself (docs/contract.md)."
    )
