"""The masks a decoder block rebuilds from the ``(N, S)`` padding mask, as the model's forward builds them once for all
blocks: by the block's layer type (:func:`layer_type`), with the ``transformers.masking_utils`` helper of that type
(:data:`MASKS`), two at once for the hybrid types (:data:`HYBRID`) and for every block of a model of one attention and
one recurrent type whose blocks take both (:func:`mixed_masks`), or the padding mask alone for a forward that builds
its mask without them (:func:`builds_own_mask`, :func:`padding_mask`); and the types whose masks cannot keep the
documents of a packed row apart (:func:`unpackable_layer_types`; packed rows: :mod:`lightning_gpipe.hf.packing`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

try:
    from transformers import masking_utils
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


def _no_mask(*, and_mask_function: Callable[..., Any] | None = None, **arguments: Any) -> None:
    """The mask of a layer that mixes no tokens (:data:`TOKENWISE`): none, as the model's forward gives it none."""
    return None


TOKENWISE = ("moe", "mlp")
"""The layer types without attention or any other mixing of tokens (Nemotron-H's ``mlp`` and ``moe`` blocks: a
feed-forward network on each token), as ``transformers`` declares them: its caches keep nothing for them
(``cache_utils`` gives them a ``DummyLayer``) and its mask mapping names no mask for them, so the model's forward
gives their blocks none."""

MASKS: dict[str, Callable[..., Any]] = {
    layer_type: helper for layer_type, helper in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.items() if callable(helper)
} | {layer_type: _no_mask for layer_type in TOKENWISE if layer_type not in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING}
"""The mask helper of each layer type the adapter rebuilds (``config.layer_types``), as ``transformers`` declares them
(``masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``): a 4-D causal mask for ``full_attention``, a sliding-window
one for ``sliding_attention``, chunked for ``chunked_attention``, the ``(N, S)`` padding mask for recurrent layers
(``linear_attention``, ``conv``; ``None`` without padding)..., and none for the layers that mix no tokens
(:data:`TOKENWISE`). Types that map to several masks at once are
:data:`HYBRID`."""


def _recurrent(helper: Callable[..., Any]) -> bool:
    """Whether a mask helper builds a recurrent layer's padding mask (no attention mask: no ``and_mask_function``)."""
    return "and_mask_function" not in inspect.signature(helper).parameters


HYBRID: dict[str, tuple[str, str]] = {
    layer_type: (attention, recurrent)
    for layer_type, helpers in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.items()
    if isinstance(helpers, dict) and len(helpers) == 2
    for attention, recurrent in [sorted(helpers, key=lambda t: t in MASKS and _recurrent(MASKS[t]))]
    if attention in MASKS and recurrent in MASKS and not _recurrent(MASKS[attention]) and _recurrent(MASKS[recurrent])
}
"""The layer types that take two masks at once, as ``transformers`` declares them (``hybrid``: ``full_attention``
and ``linear_attention``; ``hybrid_sliding``: ``sliding_attention`` and ``linear_attention``; Inkling's blocks):
``{layer type: (attention type, recurrent type)}``. A block of such a type gets the attention type's mask (of
:data:`MASKS`, as the model's forward builds it) as ``attention_mask`` and the recurrent type's under the one other
``..._mask`` argument it takes (Inkling's ``conv_mask``)."""


def mixed_masks(config: Any) -> tuple[str, str] | None:
    """``(attention type, recurrent type)`` where ``config``'s layer types are exactly one attention type and one
    recurrent one (of :data:`MASKS`, told apart as :data:`HYBRID`'s: Qwen4-Exp's ``indexed_attention`` and
    ``linear_attention``), else ``None``. A block of such a model that takes a second ``..._mask`` gets both masks
    whatever its own type, as a :data:`HYBRID` block does (Qwen4-Exp's forward gives every block the indexed
    attention's as ``attention_mask`` and the recurrent one as ``conv_mask``); the self-check proves the reading."""
    types = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    if len(types) != 2 or not types <= set(MASKS) - set(TOKENWISE):
        return None
    attention, recurrent = sorted(types, key=lambda t: _recurrent(MASKS[t]))
    return (attention, recurrent) if not _recurrent(MASKS[attention]) and _recurrent(MASKS[recurrent]) else None


def recurrent_type(name: str) -> bool:
    """Whether ``name`` is a layer type whose mask is a recurrent layer's ``(N, S)`` padding mask (:data:`MASKS`:
    ``linear_attention``, ``conv``)."""
    return name in MASKS and _recurrent(MASKS[name])


def builds_own_mask(stack: nn.Module) -> bool:
    """Whether the forward of ``stack`` (the module holding the blocks) builds its blocks' mask without
    ``transformers.masking_utils``: its code names no function defined there (decorators unwrapped). OpenAI
    GPT's builds :func:`padding_mask` (its attention masks the future with its own ``bias`` buffer); the self-check
    proves the reading."""
    own = masking_utils.__name__
    helpers = {
        name for name, item in vars(masking_utils).items() if inspect.isfunction(item) and item.__module__ == own
    }
    return not helpers & set(inspect.unwrap(type(stack).forward).__code__.co_names)


def padding_mask(*, inputs_embeds: Tensor, attention_mask: Tensor, **arguments: Any) -> Tensor:
    """The padding mask alone, inverted, as an older forward builds it for all its blocks (OpenAI GPT's): ``(N, 1, 1,
    K)`` of ``inputs_embeds``' dtype, 0 where ``attention_mask`` ``(N, K)`` keeps a token and the dtype's minimum
    where it pads one, for the blocks to add to their scores (their attention masks the future itself). Takes (and
    ignores) the other arguments of a :data:`MASKS` helper."""
    dtype = inputs_embeds.dtype
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def layer_type(config: Any, layer_index: int) -> str:
    """Block ``layer_index``'s attention type: ``config.layer_types``'s entry, else ``"sliding_attention"`` when
    ``config.sliding_window`` is set (Mistral), else ``"full_attention"``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer_index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def forward_layer_type(config: Any, layer_index: int, stack: Any) -> str:
    """:func:`layer_type`, but ``"full_attention"`` for a ``"sliding_attention"`` the model's forward does not build:
    a config without ``layer_types`` whose ``sliding_window`` the forward of ``stack`` (the module holding the
    blocks) ignores, building the causal mask (``create_causal_mask``) and no sliding-window one (Moshi's
    ``sliding_window``, which none of its modules reads)."""
    kind = layer_type(config, layer_index)
    names = getattr(inspect.unwrap(type(stack).forward), "__code__", None)
    names = set() if names is None else set(names.co_names)
    if kind == "sliding_attention" and getattr(config, "layer_types", None) is None:
        if "create_causal_mask" in names and not names & {"create_sliding_window_causal_mask", "layer_types"}:
            return "full_attention"
    return kind


def unpackable_layer_types(config: Any) -> list[str]:
    """The layer types of ``config`` that cannot keep a packed row's documents apart: those whose mask helper
    (:data:`MASKS`) builds no attention mask to narrow (it takes no ``and_mask_function``), the recurrent layers'
    padding masks (``linear_attention``, ``conv``), whose state runs along the row."""
    types = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    return sorted(t for t in types if t in HYBRID or _recurrent(MASKS[t]))
