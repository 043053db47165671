"""What an encoder-decoder's blocks take beyond a 4-D mask (:mod:`lightning_gpipe.hf.seq2seq`), computed by each
block's layer as the stack's forward computes it: the kind of a stack's attention (:func:`attention_kind`) and its
encoder blocks' inputs (:func:`encoder_inputs`, :func:`encoder_output`).

The kinds: ``"full"`` (the 4-D masks of ``transformers.masking_utils``: T5, BART...); ``"prompts"`` (MVP's blocks
take per-block prompts, ``None`` where the stack's ``use_prompt`` is off, its default); ``"local"`` (LongT5's encoder
with ``encoder_attention_type="local"``: its blocks attend within blocks of ``local_radius + 1`` tokens, the mask
``_get_local_attention_mask`` of its modeling module, and every later block's position bias is the first block's
table at the block length plus that mask, as the first block returns it to the next); ``"longformer"`` (LED's
encoder: the stack pads its input to a multiple of ``attention_window``, its blocks take the padded 2-D mask inverted
(0 kept, the dtype's minimum masked) and the masked and global positions; without a ``global_attention_mask``, which
the backbone's input lacks, no position is global); ``"global tokens"`` (Pegasus-X's encoder: the stack pads its input
to a multiple of ``block_size`` and embeds ``num_global_tokens`` global tokens, which each block updates beside the
hidden states, with the inverted 2-D mask); ``"block sparse"`` (BigBird-Pegasus's encoder: its blocks take
block-sparse masks, which its stack's forward gives only on a source longer than ``(5 + 2 * num_random_blocks) *
block_size`` tokens; on a shorter one it sets every block to full attention, for good, and gives them the 4-D mask:
:func:`full_attention`); ``"rotary"`` (T5Gemma's stacks: each block takes the rotary cos/sin of its positions, computed
with its stack's ``rotary_emb``, which every block's layer holds, and the positions). Each block's 4-D mask is that of
its layer type (:data:`ENCODER_MASKS`, :data:`DECODER_MASKS`: T5Gemma's sliding windows). Where no mask is given, the
backbone's input takes the one the stack derives (:func:`derived_mask`: T5Gemma's from the padding tokens).

With LED's and Pegasus-X's padding, between encoder layers ``source`` is ``(N, G + S', H)``: the ``G`` global tokens'
states (none but Pegasus-X's) before the ``S' >= S`` positions (the padded ones' included); the encoder's last block's
layer gives on the ``S`` positions of the source mask (:func:`encoder_output`), as the stack's forward cuts its output.
What stays refused names its structure: MVP with ``use_prompt=True`` (prompts computed once by the stack for every
block), LongT5's transient-global attention, BigBird-Pegasus's block-sparse attention (at run time, on a longer source),
layer types other than full and sliding attention, blocks taking arguments of no known kind. Source: ``transformers``
5.24's MVP (``modeling_mvp``), LongT5 (Guo et al. 2022, arXiv:2112.07916), LED (Beltagy et al. 2020, arXiv:2004.05150),
Pegasus-X (Phang et al. 2022, arXiv:2208.04347), BigBird-Pegasus (Zaheer et al. 2020, arXiv:2007.14062) and T5Gemma
(Zhang et al. 2025, arXiv:2504.06225).
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.decoder_layout import ROTARY
from lightning_gpipe.hf.masks import layer_type

try:
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_bidirectional_sliding_window_mask,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


PROMPTS = frozenset(("self_attn_prompt", "cross_attn_prompt"))
"""MVP's blocks' prompt arguments (kind ``"prompts"``)."""

LONGFORMER = frozenset(("is_index_masked", "is_index_global_attn", "is_global_attn"))
"""LED's encoder blocks' Longformer arguments (kind ``"longformer"``)."""

GLOBAL_TOKENS = frozenset(("global_hidden_states",))
"""Pegasus-X's encoder blocks' global tokens (kind ``"global tokens"``)."""

BLOCK_SPARSE = frozenset(("band_mask", "from_mask", "to_mask", "from_blocked_mask", "to_blocked_mask"))
"""BigBird-Pegasus's encoder blocks' block-sparse masks (kind ``"block sparse"``)."""

ROTARY_ARGUMENTS = frozenset(("position_embeddings", "position_ids"))
"""The rotary positions' arguments of T5Gemma's blocks (kind ``"rotary"``)."""

ENCODER_MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_bidirectional_mask,
    "sliding_attention": create_bidirectional_sliding_window_mask,
}
"""An encoder block's 4-D mask helper by its layer type (:func:`~lightning_gpipe.hf.masks.layer_type` of its stack's
config: T5Gemma's ``layer_types``), as T5Gemma's encoder builds them."""

DECODER_MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}
"""A decoder block's 4-D self-attention mask helper by its layer type, as T5Gemma's decoder builds them."""

PAD_MASK = "make_default_2d_attention_mask"
"""The function by which T5Gemma's stacks derive a mask from the padding tokens where none is given
(:func:`derived_mask`)."""

ATTENTION_TYPES = ("block_sparse", "original_full")
"""BigBird-Pegasus's attention types (its config's ``attention_type``)."""


def attention_kind(stack: nn.Module, extra: list[str], decoder: bool) -> tuple[str, str | None]:
    """``(kind, None)``: the kind of ``stack``'s attention (see the module docstring), its blocks taking the named
    arguments ``extra`` beyond :data:`~lightning_gpipe.hf.seq2seq.BLOCK_ARGUMENTS`; or ``("", why not)``."""
    config = getattr(stack, "config", None)
    names, kind = set(extra), "decoder" if decoder else "encoder"
    unknown = sorted({layer_type(config, i) for i in range(_depth(stack))} - set(ENCODER_MASKS))
    if unknown:
        return "", f"its {kind}'s layer types {unknown} are not those the layers mask ({sorted(ENCODER_MASKS)})"
    if names == ROTARY_ARGUMENTS and isinstance(getattr(stack, ROTARY, None), nn.Module):
        return "rotary", None
    if not names:
        attention = None if decoder else getattr(config, "encoder_attention_type", None)
        if attention is None:
            return "full", None
        if attention == "local":
            return "local", None
        return (
            "",
            f"its encoder's attention is {attention!r} (LongT5's transient-global), which the layers do not compute",
        )
    if names <= PROMPTS:
        if getattr(stack, "use_prompt", True):
            return "", f"its {kind} blocks take MVP's prompts (use_prompt=True), which its stack computes for them all"
        return "prompts", None
    if not decoder and names == LONGFORMER and getattr(config, "attention_window", None) is not None:
        return "longformer", None
    if not decoder and names == GLOBAL_TOKENS and getattr(config, "num_global_tokens", None) is not None:
        return "global tokens", None
    if not decoder and names == BLOCK_SPARSE and getattr(config, "attention_type", None) in ATTENTION_TYPES:
        return "block sparse", None
    return "", f"its {kind} blocks take {extra}, which the layers do not compute"


def _depth(stack: nn.Module) -> int:
    """The number of blocks of ``stack`` (its one ``nn.ModuleList``)."""
    return next((len(child) for child in stack.children() if isinstance(child, nn.ModuleList)), 0)


def _inverted(mask: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """``mask`` ``(N, S)`` padded with zeros to ``length`` and inverted: 0 where kept, ``dtype``'s minimum where
    masked, ``(N, length)``."""
    padded = nn.functional.pad(mask, (0, length - mask.shape[1]), value=0)
    return torch.zeros(padded.shape, dtype=dtype, device=mask.device).masked_fill(padded == 0, torch.finfo(dtype).min)


def encoder_inputs(
    kind: str, model: nn.Module, hidden: Tensor, mask: Tensor, extra: dict[str, Any]
) -> tuple[Tensor, Any]:
    """An encoder block's hidden states and ``attention_mask`` for the ``source`` states ``hidden`` ``(N, G + S', H)``
    (see the module docstring) and the source mask ``mask`` ``(N, S)`` of a stack ``model`` of attention ``kind``
    (``"local"``, ``"longformer"`` or ``"global tokens"``), what else the block takes put in ``extra``: the hidden
    states are those after the ``G`` global tokens (Pegasus-X's: ``extra["global_hidden_states"]``)."""
    config: Any = model.config
    if kind == "local":
        local = sys.modules[type(model).__module__]._get_local_attention_mask
        return hidden, local(mask, config.local_radius + 1, hidden.device)
    if kind == "global tokens":
        extra["global_hidden_states"] = hidden[:, : config.num_global_tokens]
        hidden = hidden[:, config.num_global_tokens :]
    inverted = _inverted(mask, hidden.shape[1], hidden.dtype)
    if kind == "longformer":
        extra.update(is_index_masked=inverted < 0, is_index_global_attn=inverted > 0, is_global_attn=False)
    return hidden, inverted


def derived_mask(stack: nn.Module, ids: Tensor, training: bool) -> Tensor:
    """The ``(N, L)`` mask that ``stack``'s forward uses for the token ids ``ids`` ``(N, L)`` when given none: ``ids
    != pad_token_id`` (its config's) where the forward derives it so (calls :data:`PAD_MASK`: T5Gemma's encoder
    always, its decoder when it keeps no cache: in ``training``, or with its config's ``use_cache`` off), else all
    ones."""
    config: Any = getattr(stack, "config", None)
    decoder = bool(getattr(config, "is_decoder", False))
    if _derives(type(stack).forward) and not (decoder and not training and getattr(config, "use_cache", False)):
        return (ids != config.pad_token_id).long()
    return torch.ones_like(ids)


@functools.cache
def _derives(forward: Callable[..., Any]) -> bool:
    """Whether a stack's ``forward`` derives a mask from the padding tokens (calls :data:`PAD_MASK`)."""
    return PAD_MASK in inspect.getsource(forward)


def full_attention(block: Any, config: Any, length: int) -> None:
    """Set BigBird-Pegasus's encoder ``block`` to full attention, as its stack's forward sets every block for a source
    of ``length`` tokens up to ``(5 + 2 * num_random_blocks) * block_size`` (of its ``config``: fewer than its
    block-sparse attention needs), and for good; nothing where it has full attention already.

    Raises:
        RuntimeError: for a longer source, while the block has block-sparse attention (which the layers do not
            compute).
    """
    if block.attention_type == "original_full":
        return
    most = (5 + 2 * config.num_random_blocks) * config.block_size
    if length > most:
        raise RuntimeError(
            f"{type(block).__name__}'s block-sparse attention (a source of {length} tokens, more than {most}) is not"
            " computed by the layers: set the config's attention_type='original_full', or give at most"
            f" {most} tokens."
        )
    block.set_attention_type("original_full")


def local_bias(holder: Any, block_length: int, mask: Tensor) -> Tensor:
    """A LongT5 local-attention block's position bias after the first ``(1, num_blocks, heads, block_length, 3 *
    block_length)``: the first block's table (``holder``, its attention) at ``block_length`` plus the local ``mask``
    (:func:`encoder_inputs`), as the first block returns it."""
    return holder.compute_bias(block_length) + torch.where(mask > 0, 0.0, -1e10).transpose(1, 2)


def encoder_output(kind: str, model: nn.Module, source: Tensor, mask: Tensor) -> Tensor:
    """The encoder's output ``(N, S, H)``: of its last block's ``source`` ``(N, G + S', H)`` the ``S`` positions of
    the source ``mask`` ``(N, S)`` after the ``G`` global tokens of a stack ``model`` of attention ``kind``, as the
    stack's forward cuts them (a view; ``source`` itself where it has ``S`` positions: ``G = 0`` and ``S' = S``, or
    the output already)."""
    if source.shape[1] == mask.shape[1]:
        return source
    skip = cast(Any, model).config.num_global_tokens if kind == "global tokens" else 0
    return source[:, skip : skip + mask.shape[1]]
