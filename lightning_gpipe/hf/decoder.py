"""Decoders as backbone layers: the standard layout of ``transformers`` 5 (found by structure) and GPT-2.

``transformers`` 5 builds most causal LMs alike (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
``MixtralForCausalLM``...): ``model.embed_tokens``, the blocks ``model.layers[i]`` called with the hidden states,
the rotary cos/sin, the 4-D mask and the cache, ``model.norm``, ``model.rotary_emb`` and ``lm_head``.
:func:`standard_decoder` recognises that layout from the modules and the config (not the class name) and
:func:`standard_decoder_layers` cuts it, handling the deviations the config declares: a multiplier on the embeddings
(Granite's ``embedding_multiplier``) or a dropout on them (StarCoder 2's ``embedding_dropout``), the hidden states
scaled before the head (MiniCPM3's ``dim_model_base``), logits scaled (``logits_scaling``, ``logit_scale``) or
soft-capped (``final_logit_softcapping``), attention by layer type
(``layer_types``: full or sliding window, each with its own rotary table where the rotary module takes a
``layer_type``; hybrid types taking an attention and a recurrent mask, :data:`HYBRID`), and mixture-of-experts
routers whose load-balancing loss travels as per-row statistics (:mod:`lightning_gpipe.hf.moe`). The declared plan
(:mod:`lightning_gpipe.hf.adapter`) adds what its :class:`DecoderCut` names: modules on the embeddings, per-layer
inputs, rotary modules per layer, hyper-connection streams, blocks of several attention layers; and the blocks get
what the model's forward gives them where they ask for it (a value carried from block to block, ``prev_...``; what
their modeling module computes from the positions, :func:`computed_arguments`; the token ids, :func:`tokens_of`;
rotary tables of several kinds, :func:`rotary_kinds`). Whatever else a class does
differently is caught by the self-check (:mod:`lightning_gpipe.hf.selfcheck`) before the first step.

Between layers only tensors travel, each with the batch in dim 0: ``(hidden (N, S, H), attention_mask (N, S),
position_ids (N, S)[, router statistics (N, 2E + 1)][, per-layer inputs (N, S, L, D)][, token ids (N, S)][, carried
(N, S, k)][, documents (N, S)][, rows (n,)])`` (``documents`` for packed rows, :func:`decoder_input`; ``rows`` for
cached decoding; per-layer inputs, token ids and a carried value only for the models whose blocks take them; with
hyper-connections the hidden states are ``(N, S, streams, H)``). Each block rebuilds what the model's forward builds
once for all blocks (the 4-D mask with ``transformers.masking_utils``, kept inside each document of a packed row, the
rotary cos/sin from the positions) and calls the block as the model's forward does.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel
from lightning_gpipe.hf.moe import RouterLoss, router_loss_of

try:
    from transformers import DynamicCache
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

MASKS: dict[str, Callable[..., Any]] = {
    layer_type: helper for layer_type, helper in LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.items() if callable(helper)
}
"""The mask helper of each layer type the adapter rebuilds (``config.layer_types``), as ``transformers`` declares them
(``masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``): a 4-D causal mask for ``full_attention``, a sliding-window
one for ``sliding_attention``, chunked for ``chunked_attention``, the ``(N, S)`` padding mask for recurrent layers
(``linear_attention``, ``conv``; ``None`` without padding)... Types that map to several masks at once are
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


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids ``(N, S)`` long of a padded batch: each row counts its real tokens from 0 (padding gets 0).

    As ``generate`` numbers left-padded prompts; for right padding or none it equals ``arange(S)`` on the real
    tokens, as the model's ``forward`` numbers them when given no positions.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(attention_mask == 0, 0)


def decoder_input(
    input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
) -> tuple[Tensor, ...]:
    """A decoder backbone's input for a training or evaluation batch, each item ``(N, S)`` long (the mask all ones
    when ``None``).

    Without ``position_ids``: ``(input_ids, attention_mask, position_ids)``, positions ``0 .. S-1`` as the model's
    forward numbers a batch given no positions. With them, a batch of packed rows (several documents in a row, each
    numbered from 0): ``(input_ids, attention_mask, position_ids, documents)``, where ``documents`` numbers each
    row's documents (a new one wherever a real token's position is 0; the padding at a row's end goes with its last
    document) and every block keeps attention inside a document (:func:`document_mask`). Tensor operations only: no
    host synchronisation.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if position_ids is not None:
        documents = ((position_ids == 0) & (mask != 0)).long().cumsum(-1)
        return input_ids, mask, position_ids, documents
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1).contiguous()
    return input_ids, mask, positions


def pack_documents(documents: Sequence[Sequence[int]], row_length: int, window: int = 64) -> list[list[Sequence[int]]]:
    """``documents`` (token ids each) packed into rows of at most ``row_length`` tokens, no document split: each goes
    to the first of the last ``window`` rows it fits in, else starts a row (first fit over a window: rows come out
    nearly full, in about the documents' order, in ``O(len(documents) * window)``).

    Raises:
        ValueError: for a document longer than ``row_length`` (cut it first).
    """
    rows: list[list[Sequence[int]]] = []
    free: list[int] = []  # tokens left in each row
    for document in documents:
        if len(document) > row_length:
            raise ValueError(f"A document of {len(document)} tokens does not fit rows of {row_length}: cut it first.")
        first = max(len(rows) - window, 0)
        row = next((i for i in range(first, len(rows)) if free[i] >= len(document)), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(document)
        free[row] -= len(document)
    return rows


def packed_batch(rows: Sequence[Sequence[Sequence[int]]], pad_token_id: int) -> dict[str, Any]:
    """A batch of packed rows (:func:`pack_documents`) as :class:`~lightning_gpipe.hf.CausalLM` takes it.

    ``input_ids``, ``attention_mask`` (1 on tokens, 0 on the padding at a row's end), ``position_ids`` (each
    document numbered from 0) and ``labels`` (the ids; ``-100`` on padding and on each document's first token, so no
    token predicts the next document's), each ``(N, S)`` long with ``S`` the longest row; and two ints of the whole
    batch, ``num_targets`` (the tokens predicted: each document's length less one) and ``num_rows``, which make the
    loss the mean over the batch's targets under every schedule (:meth:`~lightning_gpipe.hf.CausalLM.loss`).
    """
    length = max(sum(len(document) for document in row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask, positions = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, row in enumerate(rows):
        start = 0
        for document in row:
            end = start + len(document)
            ids[r, start:end] = torch.tensor(document, dtype=torch.long)
            mask[r, start:end] = 1
            positions[r, start:end] = torch.arange(len(document))
            labels[r, start + 1 : end] = ids[r, start + 1 : end]
            start = end
    targets = sum(max(len(document) - 1, 0) for row in rows for document in row)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "labels": labels,
        "num_targets": targets,
        "num_rows": len(rows),
    }


def same_document(documents: Tensor) -> Callable[..., Tensor]:
    """The mask function (``transformers.masking_utils``' ``and_mask_function``) that lets a query attend only to the
    keys of its own document: ``documents[b, q] == documents[b, kv]``, with ``documents`` ``(N, S)`` long (see
    :func:`decoder_input`); :func:`document_mask`'s way for masks other than eager's and SDPA's."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return documents[batch_idx, q_idx] == documents[batch_idx, kv_idx]

    return inner


def document_mask(helper: Callable[..., Any], documents: Tensor, **arguments: Any) -> Any:
    """A layer type's mask (``helper``, one of :data:`MASKS`, given ``arguments``) kept inside each document of packed
    rows (``documents`` ``(N, S)``, see :func:`decoder_input`): block-diagonal.

    The helper builds the layer type's mask for the attention implementation as for any batch (causal, sliding window
    or chunked, with the padding), without its check whether the mask may be skipped (a host read of the padding
    mask); then a key of another document is masked out: ``False`` in an SDPA boolean mask, the dtype's minimum in an
    eager additive one. Tensor operations only. For another kind of mask (a flex-attention block mask...) the helper
    builds it with :func:`same_document` as its ``and_mask_function`` (element by element: slower).
    """
    mask = helper(**arguments, allow_is_causal_skip=False)
    if isinstance(mask, Tensor) and mask.dim() == 4:
        same = documents[:, None, :, None] == documents[:, None, None, :]
        if mask.dtype == torch.bool:
            return mask & same
        if mask.is_floating_point():
            return mask.masked_fill(~same, torch.finfo(mask.dtype).min)
    return helper(**arguments, and_mask_function=same_document(documents))


def unpackable_layer_types(config: Any) -> list[str]:
    """The layer types of ``config`` that cannot keep a packed row's documents apart: those whose mask helper
    (:data:`MASKS`) builds no attention mask to narrow (it takes no ``and_mask_function``), the recurrent layers'
    padding masks (``linear_attention``, ``conv``), whose state runs along the row."""
    types = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    return sorted(t for t in types if t in HYBRID or _recurrent(MASKS[t]))


def causal_lm_loss(
    output: Tensor | tuple[Tensor, Tensor], labels: Tensor, router: RouterLoss | None, num_targets: int | None = None
) -> Tensor:
    """A causal LM's loss from its backbone's output, as the model's forward computes it with ``labels``.

    Next-token cross-entropy over the labelled tokens (``ForCausalLMLoss``: ``labels`` ``(N, S)`` long, ``-100``
    where no loss is wanted), plus ``router.coefficient`` times the load-balancing loss of the router statistics
    when the output is ``(logits (N, S, V), statistics (N, 2E + 1))`` (a mixture of experts with
    ``output_router_logits=True``, see :mod:`lightning_gpipe.hf.moe`). The cross-entropy is the mean over these
    labelled tokens, or with ``num_targets`` their sum over ``num_targets`` (``transformers``' ``num_items_in_batch``:
    the targets of a whole batch of which ``labels`` are some rows).
    """
    logits, statistics = output if isinstance(output, tuple) else (output, None)
    # an int divides on the device (transformers takes one, though it annotates a tensor): no host-to-device copy
    loss = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=cast(Any, num_targets))
    if statistics is not None and router is not None:
        loss = loss + router.coefficient * router.aux_loss(statistics)
    return loss


def _unpack(value: tuple[Tensor, ...], router: RouterLoss | None, tokens: bool = False):
    """``(hidden, attention_mask, position_ids, statistics, documents, rows)`` of a decoder value, ``None`` for what
    it does not carry: packed rows carry ``documents`` ``(N, S)``, cached decoding ``rows`` ``(n,)`` (and a value
    carried from block to block, :func:`carried_of`, has 3 dimensions or more). With ``tokens`` the value carries the
    token ids ``(N, S)`` for the blocks (:func:`tokens_of`) before ``documents``."""
    hidden, attention_mask, position_ids, *rest = value
    statistics = rest.pop(0) if router is not None else None
    documents = [item for item in rest if item.dim() == 2][1 if tokens else 0 :]
    rows = next((item for item in rest if item.dim() == 1), None)
    return hidden, attention_mask, position_ids, statistics, next(iter(documents), None), rows


def tokens_of(value: tuple[Tensor, ...], router: RouterLoss | None) -> Tensor:
    """The token ids ``(N, S)`` a value carries for blocks that take them (DeepSeek-V4's, whose hash-routed experts
    choose by token, see :class:`DecoderEmbedding`): its first item of 2 dimensions after the hidden states, mask,
    positions and router statistics."""
    return next(item for item in value[4 if router is not None else 3 :] if item.dim() == 2)


def carried_of(value: tuple[Tensor, ...], dim: int = 3) -> Tensor | None:
    """The item after the hidden states, mask and positions with ``dim`` dimensions, or ``None`` (router statistics
    have 2, ``documents`` 2, ``rows`` 1): with 3, the value a block gave the next (GLM-MoE-DSA's top-k indices ``(N, S,
    k)``, see :class:`RotaryDecoderBlock`); with 4, the per-layer inputs ``(N, S, L, D)`` the embedding gives every
    block (Gemma 4's, see :class:`DecoderEmbedding`)."""
    return next((item for item in value[3:] if item.dim() == dim), None)


def _pack(*items: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(item for item in items if item is not None)


class DecoderEmbedding(HFLayer):
    """Token (and learned position) embeddings of a decoder: ``(input_ids, attention_mask, position_ids[,
    documents][, rows])``, each ``(N, S)`` long (packed rows' ``documents``, see :func:`decoder_input`; rows ``(n,)``,
    see :class:`CachedDecoderBlock`), to ``(hidden (N, S, H), attention_mask, position_ids[, statistics][,
    documents][, rows])``.

    Args:
        model: the model.
        tokens: path of the token embedding (``"model.embed_tokens"``).
        positions: path of a learned position embedding (GPT-2's ``"transformer.wpe"``), or ``None`` (rotary).
        dropout: path of the dropout after the embeddings, or ``None``.
        multiplier: a factor on the embeddings (Granite's ``config.embedding_multiplier``), or ``None``.
        dropout_p: the probability of a dropout on the embeddings in training (StarCoder 2's
            ``config.embedding_dropout``, as ``nn.functional.dropout``), or ``None``.
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss`: the layer starts each row's router
            statistics at zero; ``None`` (default) for none.
        extensions: paths of modules the model's forward applies to ``(input_ids, embeddings)`` right after the
            token embedding (Phi-4-multimodal's ``embed_tokens_extend``, which merges image and audio features
            into the embeddings and, for text, gives them back unchanged); default none.
        per_layer: ``(path of the base model, paths of its per-layer embedding modules)`` for a model whose base
            model computes per-layer inputs from the tokens and the embeddings (Gemma 4's ``get_per_layer_inputs``
            and ``project_per_layer_inputs``): the layer computes them as its forward does and passes them on, ``(N,
            S, L, D)`` after the positions (and router statistics), for each block to take its own; ``None``
            (default) for none.
        streams: the number of hyper-connection streams (HY-V4's ``config.hc_mult``): the embeddings are repeated
            into ``(N, S, streams, H)`` for the blocks, as the model's forward does; ``None`` (default) for none.
        pass_tokens: pass the token ids on to blocks that take them (DeepSeek-V4's ``input_ids``, see
            :func:`tokens_of`); default ``False``.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokens: str,
        positions: str | None = None,
        dropout: str | None = None,
        multiplier: float | None = None,
        dropout_p: float | None = None,
        router: RouterLoss | None = None,
        extensions: Sequence[str] = (),
        per_layer: tuple[str, Sequence[str]] | None = None,
        streams: int | None = None,
        pass_tokens: bool = False,
    ) -> None:
        own = [] if per_layer is None else list(per_layer[1])
        super().__init__(model, [p for p in (tokens, *extensions, *own, positions, dropout) if p is not None])
        self._tokens, self._positions, self._dropout = tokens, positions, dropout
        self.multiplier, self.dropout_p, self.router = multiplier, dropout_p, router
        self._extensions = tuple(extensions)
        self._per_layer_base = None if per_layer is None else per_layer[0]
        self.streams, self.pass_tokens = streams, pass_tokens

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, attention_mask, position_ids, *rows = value
        hidden = self.part(self._tokens)(input_ids)
        for extension in self._extensions:
            hidden = self.part(extension)(input_ids, hidden)
        per_layer = None
        if self._per_layer_base is not None:  # the base model's own methods, on the modules this layer holds
            base = cast(Any, self.hf_model.get_submodule(self._per_layer_base))
            per_layer = base.project_per_layer_inputs(hidden, base.get_per_layer_inputs(input_ids, hidden))
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self._positions is not None:
            hidden = hidden + self.part(self._positions)(position_ids).to(hidden.device)
        if self._dropout is not None:
            hidden = self.part(self._dropout)(hidden)
        if self.dropout_p is not None:
            hidden = nn.functional.dropout(hidden, p=self.dropout_p, training=self.training)
        if self.streams is not None:  # hyper-connections: the blocks take (N, S, streams, H)
            hidden = hidden.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        statistics = None
        if self.router is not None:
            statistics = torch.zeros(input_ids.shape[0], self.router.width, device=hidden.device)
        given = input_ids if self.pass_tokens else None
        return _pack(hidden, attention_mask, position_ids, statistics, per_layer, given, *rows)


def layer_type(config: Any, layer_index: int) -> str:
    """Block ``layer_index``'s attention type: ``config.layer_types``'s entry, else ``"sliding_attention"`` when
    ``config.sliding_window`` is set (Mistral), else ``"full_attention"``."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return layer_types[layer_index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


class CachedDecoderBlock(HFLayer):
    """A decoder block that can keep its own key/value cache for incremental decoding.

    In training and plain evaluation the value is ``(hidden (N, S, H), attention_mask (N, S), position_ids (N,
    S)[, statistics])`` and the block runs without a cache. For cached decoding (see
    :func:`~lightning_gpipe.hf.greedy_generate`) the value ends with one more item, ``rows`` ``(n,)`` long: which
    sequences of the batch these are. ``hidden`` and ``position_ids`` are then only the new tokens ``(n, t)``,
    while ``attention_mask`` ``(n, past + t)`` covers every token so far; the block keeps one
    ``transformers.DynamicCache`` per set of rows (one per micro-batch: a pipeline splits every decoding step of a
    batch alike), in which the model's attention appends the new keys and values, and builds the 4-D mask against
    it as the model's forward does. So only the new tokens' hidden states travel between stages, and each stage
    holds the caches of its own blocks only. :func:`clear_kv_caches` empties them.

    Args:
        model: the model.
        paths: the paths of the modules it holds (the block first).
        layer_index: the block's index in the model (its attention's ``layer_idx``, which mask it uses).
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss` when the value carries router statistics,
            else ``None`` (default).

    Attributes:
        kv_cache: ``{rows: DynamicCache}``, the caches of cached decoding (not part of the state dict).
    """

    def __init__(
        self, model: PreTrainedModel, paths: list[str], layer_index: int, router: RouterLoss | None = None
    ) -> None:
        super().__init__(model, paths)
        self.layer_index, self.router = layer_index, router
        self.layer_type = layer_type(model.config, layer_index)
        attention, recurrent = HYBRID.get(self.layer_type, (self.layer_type, None))
        self._mask = MASKS[attention]
        self._recurrent_mask = None if recurrent is None else MASKS[recurrent]
        self.kv_cache: dict[tuple[int, ...], Any] = {}

    def cache_and_mask(
        self,
        hidden: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        rows: Tensor | None,
        documents: Tensor | None = None,
    ):
        """The cache of ``rows`` (``None`` without rows) and the block's mask against it; with ``documents`` (packed
        rows, see :func:`decoder_input`) kept inside each document (:func:`same_document`); for a layer type of
        :data:`HYBRID`, the mask is ``(attention mask, recurrent mask)``.

        Raises:
            RuntimeError: if ``attention_mask`` covers earlier tokens whose keys and values this block has not
                cached for these rows (caches cleared or the batch split differently mid-decoding).
        """
        cache = None
        if rows is not None:
            key = tuple(rows.tolist())
            past = attention_mask.shape[1] - hidden.shape[1]
            cache = self.kv_cache.get(key)
            if cache is None and past == 0:
                cache = self.kv_cache[key] = DynamicCache(config=self.config)
            seen = None if cache is None else cache.get_seq_length(self.layer_index)
            if seen != past:
                raise RuntimeError(
                    f"Block {self.layer_index} holds {seen or 0} cached positions for rows {list(key)} but the"
                    f" attention mask says {past} came before: start cached decoding with the whole prompts, feed"
                    " each later step the new tokens of the same rows (every step split alike), and call"
                    " `clear_kv_caches(backbone)` between generations."
                )
        arguments = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=self.layer_index,
        )
        mask = self._mask(**arguments) if documents is None else document_mask(self._mask, documents, **arguments)
        if self._recurrent_mask is not None:  # a hybrid layer type: (attention mask, recurrent mask)
            mask = (mask, self._recurrent_mask(**arguments))
        return cache, mask


def clear_kv_caches(backbone: nn.Module) -> None:
    """Empty the key/value caches of ``backbone``'s decoder blocks (those this process holds), freeing them."""
    for module in backbone.modules():
        if isinstance(module, CachedDecoderBlock):
            module.kv_cache = {}


class RotaryDecoderBlock(CachedDecoderBlock):
    """One block of the standard decoder layout: ``(hidden, attention_mask, position_ids[, statistics][, rows])``
    to the same, the block applied.

    Rebuilds the block's 4-D mask (by its layer type: causal or sliding-window, for the configured attention
    implementation) from the ``(N, S)`` padding mask, and the rotary cos/sin from the positions with the model's
    rotary module (for the block's layer type when the module takes one, as Gemma 3's), then calls the block as the
    model's forward does: the cache under the name the block takes (``cache``, GPT-NeoX's ``layer_past``). With router
    statistics, adds those of the block's routers (:mod:`lightning_gpipe.hf.moe`). With ``rows``, decodes
    incrementally with its own key/value cache (see :class:`CachedDecoderBlock`). A block taking an argument named
    ``prev_...`` (:data:`CARRIED`; GLM-MoE-DSA's ``prev_topk_indices``) gives ``(hidden, what the next block takes
    there)``, as the model's forward passes it on: the layer carries it in the value to the next block's layer
    (:func:`carried_of`; the first block gets ``None``, as in the model's forward).

    Args:
        model: the model.
        block: path of the block (``"model.layers.2"``).
        rotary: path of the rotary embedding the block's layer calls (``"model.rotary_emb"``; Granite-SWA's
            ``"model.rotary_embs.1"``, the one of its layer's ``rope_theta``); held by every block layer (its
            buffers are not saved, so no name is added to the checkpoint). ``None`` for a model without one, or a
            block the forward gives none (its blocks get no ``position_embeddings``).
        layer_index: the index in the model of the block's first attention layer (which mask it uses, its cache's
            layer: ``i * k`` for blocks of ``k`` attention sublayers, LongCat-Flash's two).
        router: see :class:`CachedDecoderBlock`.
        held: paths of other modules the layer holds without calling them (rotary modules the model builds and its
            forward leaves unused: Granite-SWA's ``model.rotary_emb``); default none.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        block: str,
        rotary: str | None,
        layer_index: int,
        router: RouterLoss | None = None,
        held: Sequence[str] = (),
    ) -> None:
        paths = [block, *([] if rotary is None else [rotary]), *(p for p in held if p != rotary)]
        super().__init__(model, paths, layer_index, router)
        self._block, self._rotary = block, rotary
        typed = rotary is not None and "layer_type" in inspect.signature(self.part(rotary).forward).parameters
        self._rotary_type = (self.layer_type,) if typed else ()
        self._routers = [] if router is None else router.routers(self.part(block), block)
        arguments = inspect.signature(self.part(block).forward).parameters
        self._cache_argument = "layer_past" if "layer_past" in arguments and "cache" not in arguments else "cache"
        self._carry = next((name for name in arguments if name.startswith(CARRIED)), None)
        self._block_index = int(block.rsplit(".", 1)[1])
        self._second_mask = next((n for n in arguments if n.endswith("_mask") and n != "attention_mask"), None)
        self._per_layer, self._shared_kv = "per_layer_input" in arguments, "shared_kv_states" in arguments
        self._computed = computed_arguments(self.part(block))
        self.tokens = "input_ids" in arguments
        rope = getattr(model.config, "rope_parameters", None)
        self._kinds = rotary_kinds(model.config) if typed else []
        self._nope = (
            bool(typed) and isinstance(rope, dict) and self.layer_type in rope and rope[self.layer_type] is None
        )

    def _arguments(self, value: tuple[Tensor, ...], hidden: Tensor, position_ids: Tensor, mask: Any) -> dict:
        """What the model's forward gives the block besides the hidden states, the cache and the positions."""
        arguments: dict[str, Any] = {"attention_mask": mask}
        if self._nope:  # a layer type without rotary parameters: none, and what the model computes instead
            arguments["position_embeddings"] = None
        elif self._kinds:  # a table per kind the config names, all for every block (DeepSeek-V4's main, compress)
            rotary = self.part(cast(str, self._rotary))
            arguments["position_embeddings"] = {kind: rotary(hidden, position_ids, kind) for kind in self._kinds}
        elif self._rotary is not None:
            arguments["position_embeddings"] = self.part(self._rotary)(hidden, position_ids, *self._rotary_type)
        if self.tokens:
            arguments["input_ids"] = tokens_of(value, self.router)
        for name, compute in self._computed.items():
            arguments[name] = compute(position_ids) if self._nope else None
        if self._carry is not None:
            arguments[self._carry] = carried_of(value)
        if self._per_layer:  # Gemma 4: its own slice of the per-layer inputs, None where the model computes none
            per_layer = carried_of(value, 4)
            arguments["per_layer_input"] = None if per_layer is None else per_layer[:, :, self._block_index, :]
        if self._shared_kv:  # no layer reads another's keys and values (kv_sharing_reason): each its own store
            arguments["shared_kv_states"] = {}
        if isinstance(mask, tuple):  # a hybrid layer type: the recurrent mask under the block's other mask argument
            arguments["attention_mask"], arguments[cast(str, self._second_mask)] = mask
        return arguments

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, statistics, documents, rows = _unpack(value, self.router, self.tokens)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows, documents)
        arguments = self._arguments(value, hidden, position_ids, mask)
        # statistics come with a router only (_unpack)
        recording: AbstractContextManager[list[Tensor]] = (
            cast(RouterLoss, self.router).recording(self._routers) if statistics is not None else nullcontext([])
        )
        with recording as router_logits:
            output = self.part(self._block)(
                hidden,
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_argument: cache},
                **arguments,
            )
        given = None
        if self._carry is not None:  # the block gives (hidden, what the next block takes)
            output, given = output
        for logits in router_logits:
            assert self.router is not None  # router logits are recorded with a router only
            statistics = statistics + self.router.statistics(logits, attention_mask[:, -hidden.shape[1] :])
        per_layer, tokens = carried_of(value, 4), tokens_of(value, self.router) if self.tokens else None
        return _pack(output, attention_mask, position_ids, statistics, per_layer, tokens, given, documents, rows)


class GPT2Block(CachedDecoderBlock):
    """One GPT-2 block: ``(hidden, attention_mask, position_ids[, rows])`` to the same, with the causal mask
    rebuilt; with ``rows``, decodes incrementally with its own key/value cache (see :class:`CachedDecoderBlock`).

    Args:
        model: the model.
        block: path of the block (``"transformer.h.2"``).
        layer_index: the block's index in the model; default: the number in ``block``'s path.
    """

    def __init__(self, model: PreTrainedModel, block: str, layer_index: int | None = None) -> None:
        super().__init__(model, [block], int(block.rsplit(".", 1)[1]) if layer_index is None else layer_index)
        self._block = block

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, _, documents, rows = _unpack(value, None)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows, documents)
        hidden = self.part(self._block)(
            hidden, cache, mask, None, use_cache=cache is not None, position_ids=position_ids
        )
        return _pack(hidden, attention_mask, position_ids, documents, rows)


class FinalNorm(HFLayer):
    """The final norm: ``(hidden, ...)`` to the normalised hidden states ``(N, S, H)``, or ``(hidden,
    statistics)`` when the value carries router statistics (the head needs nothing else).

    Args:
        model: the model.
        norm: path of the norm (``"model.norm"``).
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss` when the value carries router statistics,
            else ``None`` (default).
        divisor: what the normalised hidden states are divided by before the head (MiniCPM3's
            ``config.logits_scaling``, ``hidden_size / dim_model_base``), or ``None`` (default).
        collapse: path of a module the model's forward applies before the norm (HY-V4's ``"model.hc_head"``, which
            collapses the hyper-connection streams, see :class:`DecoderCut`), or ``None`` (default).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        norm: str,
        router: RouterLoss | None = None,
        divisor: float | None = None,
        collapse: str | None = None,
    ) -> None:
        super().__init__(model, [norm] if collapse is None else [collapse, norm])
        self._norm, self.router, self.divisor, self._collapse = norm, router, divisor, collapse

    def forward(self, value: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, _, _, statistics, _, _ = _unpack(value, self.router)
        if self._collapse is not None:
            hidden = self.part(self._collapse)(hidden)
        hidden = self.part(self._norm)(hidden)
        if self.divisor is not None:
            hidden = hidden / self.divisor
        return hidden if statistics is None else (hidden, statistics)


class Head(HFLayer):
    """A causal LM's output head: the final norm's hidden states ``(N, S, H)`` to logits ``(N, S, V)`` (or
    ``(hidden, statistics)`` to ``(logits, statistics)``), scaled as the model's forward scales them.

    Args:
        model: the model.
        head: path of the head (``"lm_head"``).
        multiplier: a factor on the logits (Cohere's ``config.logit_scale``), or ``None``.
        divisor: what the logits are divided by (Granite's ``config.logits_scaling``), or ``None``.
        softcap: ``c`` of the soft-capping ``c * tanh(logits / c)`` (Gemma 2's ``config.final_logit_softcapping``),
            or ``None``.
        vocab: how many of the head's outputs are logits (Inkling's ``config.unpadded_vocab_size``, the rest
            padding), or ``None`` (default: all).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        head: str,
        multiplier: float | None = None,
        divisor: float | None = None,
        softcap: float | None = None,
        vocab: int | None = None,
    ) -> None:
        super().__init__(model, [head])
        self._head = head
        self.multiplier, self.divisor, self.softcap, self.vocab = multiplier, divisor, softcap, vocab

    def forward(self, value: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, *statistics = value if isinstance(value, tuple) else (value,)
        logits = self.part(self._head)(hidden)
        if self.vocab is not None:
            logits = logits[..., : self.vocab]
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits, *statistics) if statistics else logits


STANDARD_BASE = ("embed_tokens", "layers", "norm", "rotary_emb")
"""The modules of a standard decoder's base model, and nothing else."""

BLOCK_ARGUMENTS = frozenset(
    ("hidden_states", "attention_mask", "position_embeddings", "position_ids", "cache", "layer_past", "use_cache")
    + ("output_attentions", "per_layer_input", "shared_kv_states", "input_ids")
)
"""The named arguments a decoder block may take: what the adapter gives it as the model's forward does (the hidden
states, the 4-D mask, the rotary cos/sin, the positions, the cache, as ``cache`` or GPT-NeoX's ``layer_past``, and
whether to use it), and ``output_attentions``, which both leave at its default; besides one named ``prev_...``
(:data:`CARRIED`)."""

CARRIED = "prev_"
"""The prefix of a block argument that takes what the previous block gave (GLM-MoE-DSA's ``prev_topk_indices``):
such a block returns ``(hidden, that value)`` and :class:`RotaryDecoderBlock` carries it to the next block."""

ADVICE = (
    "Register a Family whose layers compute what the model's forward gives its blocks (docs/transformers.md, 'Adding"
    " a family')"
)
"""What a user can do about a decoder the adapter does not take."""


def base_model_reason(model: nn.Module) -> str | None:
    """``None`` when ``model``'s ``base_model_prefix`` names one of its children, and its children are exactly that
    base model and ``lm_head``; else why not (Llama 4's text model names ``language_model`` but holds ``model``)."""
    prefix = getattr(model, "base_model_prefix", "")
    children = sorted(name for name, child in model._modules.items() if child is not None)
    if prefix not in children:
        return (
            f"its base_model_prefix {prefix!r} names none of its children {children}: the adapter finds the base"
            f" model under that prefix, as transformers does (`model.base_model`), so it does not follow this one."
            f" {ADVICE}"
        )
    if children != sorted([prefix, "lm_head"]):
        return f"its children are {children}, not exactly the base model `{prefix}` and lm_head"
    return None


def layer_types_reason(config: Any, rotary: nn.Module | None = None) -> str | None:
    """``None`` when the adapter rebuilds the mask the model's forward gives every layer type of ``config``, else why
    not: a type neither in :data:`MASKS` nor in :data:`HYBRID`. (A type the config gives no rotary parameters, with a
    ``rotary`` module per layer type, gets no rotary embedding and what its modeling module computes for it instead:
    Beam's ``full_attention`` layers, :func:`computed_arguments`.)"""
    types = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)})
    unknown = [t for t in types if t not in MASKS and t not in HYBRID]
    if unknown:
        return (
            f"its layer types include {unknown}, which the adapter does not know: it rebuilds the masks"
            f" {', '.join([*MASKS, *HYBRID])} layers take (transformers' LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING)."
            f" {ADVICE}"
        )
    return None


def rotary_kinds(config: Any) -> list[str]:
    """The kinds of rotary table a config names that are no layer types (DeepSeek-V4's ``rope_parameters`` ``{"main":
    ..., "compress": ...}``): the model's forward gives every block all of them, ``{kind: (cos, sin)}``; empty where
    the config's rotary parameters are one set or one per layer type."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope or not all(isinstance(v, dict) for v in rope.values()):
        return []
    types = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    return [] if types & set(rope) else list(rope)


def computed_arguments(block: nn.Module) -> dict[str, Callable[[Tensor], Tensor]]:
    """The arguments of ``block`` that its modeling module computes from the positions, by name: ``X`` where the
    module defines ``compute_X(position_ids)`` (Beam's ``attention_scaling``, which its forward gives the layers of
    a type without rotary parameters, and ``None`` the others; see :class:`RotaryDecoderBlock`)."""
    module = sys.modules.get(type(block).__module__)
    names = inspect.signature(block.forward).parameters
    found = {name: getattr(module, f"compute_{name}", None) for name in names}
    return {name: compute for name, compute in found.items() if callable(compute)}


def kv_sharing_reason(config: Any) -> str | None:
    """``None`` unless layers of ``config`` reuse the keys and values of earlier layers (``num_kv_shared_layers``:
    Gemma 3n, Gemma 4), which the adapter does not carry from block to block (the blocks of a model without such
    layers get an empty store of their own, ``shared_kv_states``)."""
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared:
        return (
            f"its last {shared} layers reuse the keys and values of earlier layers (num_kv_shared_layers={shared}),"
            " which the adapter does not carry between blocks: set num_kv_shared_layers=0 if your checkpoint has no"
            f" such layers. {ADVICE}"
        )
    return None


def block_arguments_reason(block: nn.Module, config: Any = None) -> str | None:
    """``None`` when ``block``'s forward takes no named argument beyond :data:`BLOCK_ARGUMENTS` (and one named
    ``prev_...``, :data:`CARRIED`; where ``config`` has a layer type of :data:`HYBRID`, one more ``..._mask``), else
    why not (the model's forward computes something else for it: Beam's ``attention_scaling``)."""
    parameters = inspect.signature(block.forward).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    extra = [p.name for p in parameters if p.kind in named and p.name not in BLOCK_ARGUMENTS]
    extra = [name for name in extra if name not in computed_arguments(block)]
    carried = [name for name in extra if name.startswith(CARRIED)]
    masks = [name for name in extra if name.endswith("_mask")]
    hybrid = config is not None and any(layer_type(config, i) in HYBRID for i in range(config.num_hidden_layers))
    if hybrid and len(masks) != 1:
        return (
            f"its layer types take an attention and a recurrent mask at once ({', '.join(HYBRID)}), but its blocks"
            f" ({type(block).__name__}) take {len(masks)} mask arguments besides attention_mask, not one. {ADVICE}"
        )
    for allowed in (carried, masks if hybrid else []):
        if len(allowed) == 1:
            extra.remove(allowed[0])
    if extra:
        return (
            f"its blocks ({type(block).__name__}) take {extra}, which the model's forward computes for them and the"
            f" adapter does not. {ADVICE}"
        )
    return None


def bidirectional(config: Any) -> bool:
    """Whether ``config``'s text tokens attend both ways: ``use_bidirectional_attention`` ``True`` or ``"all"``
    (Gemma 4 Unified's ``"vision"``: only image tokens do, the text stays causal)."""
    value = getattr(config, "use_bidirectional_attention", False)
    return value is True or value == "all"


def standard_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the standard decoder layout (see the module docstring), else why not: its
    children must be exactly the base model (``base_model_prefix``) and ``lm_head``, the base model's exactly
    :data:`STANDARD_BASE` (the blocks an ``nn.ModuleList`` of ``num_hidden_layers``), every layer type one the
    adapter rebuilds (:func:`layer_types_reason`) and the blocks taking what it gives them
    (:func:`block_arguments_reason`)."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    reason = base_model_reason(model)
    if reason is not None:
        return reason
    prefix, config = model.base_model_prefix, model.config
    base = model.get_submodule(prefix)
    inner = sorted(name for name, child in base._modules.items() if child is not None)
    if inner != sorted(STANDARD_BASE):
        return f"`{prefix}` holds {inner}, not exactly {list(STANDARD_BASE)}"
    if not isinstance(base.layers, nn.ModuleList) or len(base.layers) != config.num_hidden_layers:
        return f"`{prefix}.layers` is not an nn.ModuleList of num_hidden_layers blocks"
    if bidirectional(config):
        return "use_bidirectional_attention=True (a bidirectional encoder, not a causal LM)"
    return layer_types_reason(config, base.get_submodule("rotary_emb")) or block_arguments_reason(
        base.layers[0], config
    )


def head_scaling(config: Any) -> tuple[float | None, dict[str, Any]]:
    """How the model's forward scales its output, as its config declares it: ``(divisor of the final norm's output,
    the :class:`Head`'s keyword arguments)``.

    MiniCPM3 (``dim_model_base``) divides the hidden states by ``logits_scaling = hidden_size / dim_model_base``
    before the head, Inkling by ``logits_mup_width_multiplier``; Granite divides the logits by ``logits_scaling``,
    Cohere multiplies them by ``logit_scale``, Gemma 2 and 3 soft-cap them (``final_logit_softcapping``); Inkling
    keeps the first ``unpadded_vocab_size``.
    """
    hidden_divisor = getattr(config, "logits_mup_width_multiplier", None)
    if getattr(config, "dim_model_base", None) is not None:
        hidden_divisor = config.logits_scaling
    vocab = getattr(config, "unpadded_vocab_size", None)
    head = {
        "multiplier": getattr(config, "logit_scale", None),
        "divisor": None if hidden_divisor is not None else getattr(config, "logits_scaling", None),
        "softcap": getattr(config, "final_logit_softcapping", None),
        "vocab": vocab if vocab is not None and vocab < config.vocab_size else None,
    }
    return hidden_divisor, head


def own_field(config: Any, name: str) -> Any:
    """``config``'s field ``name``, or ``None`` where it has none or ``name`` is an alias of another field
    (``attribute_map``: Inkling's ``embedding_multiplier`` reads its ``logits_mup_width_multiplier``, which its
    forward applies before the head, not to the embeddings)."""
    if name in getattr(config, "attribute_map", {}):
        return None
    return getattr(config, name, None)


@dataclass(frozen=True)
class DecoderCut:
    """Where a decoder is cut: the paths in the model of the modules each backbone layer holds.

    Attributes:
        embedding: the token embedding (``"model.embed_tokens"``, GPT-NeoX's ``"gpt_neox.embed_in"``).
        dropout: a module applied to the embeddings before the blocks (Phi's ``"model.embed_dropout"``), or ``None``.
        blocks: the ``nn.ModuleList`` of blocks (``"model.layers"``).
        rotary: the rotary embedding every block's layer holds (``"model.rotary_emb"``), or ``None``.
        norm: the final norm (``"model.norm"``, Phi's ``"model.final_layernorm"``).
        head: the output head (``"lm_head"``).
        extensions: modules applied to ``(input_ids, embeddings)`` after the embedding (Phi-4-multimodal's
            ``"model.embed_tokens_extend"``, see :class:`DecoderEmbedding`); default none.
        rotaries: an ``nn.ModuleList`` of rotary embeddings, one per ``rope_theta`` of the config's per-layer
            ``layer_rope_theta`` (Granite-SWA's ``"model.rotary_embs"``; a theta of 0: no rotary), which the
            blocks call instead of ``rotary`` (see :func:`block_rotary`); default ``None``.
        per_layer: the base model's per-layer embedding modules (Gemma 4's ``"model.embed_tokens_per_layer"``,
            ``"model.per_layer_model_projection"``, ``"model.per_layer_projection_norm"``), held by the embedding
            layer, which computes the per-layer inputs with the base model's own methods (see
            :class:`DecoderEmbedding`); default none.
        collapse: with hyper-connections (``config.hc_mult`` streams of hidden states, which the embedding layer
            makes), the module that collapses them before the final norm (HY-V4's ``"model.hc_head"``); default
            ``None``.
    """

    embedding: str
    dropout: str | None
    blocks: str
    rotary: str | None
    norm: str
    head: str
    extensions: tuple[str, ...] = ()
    rotaries: str | None = None
    per_layer: tuple[str, ...] = ()
    collapse: str | None = None

    def describe(self) -> str:
        """The cut as a line: ``"model.embed_tokens -> model.layers.* -> model.norm -> lm_head"``."""
        first = [self.embedding, *self.extensions, *([self.dropout] if self.dropout else [])]
        last = [*([self.collapse] if self.collapse else []), self.norm, self.head]
        return " -> ".join([*first, f"{self.blocks}.*", *last])


def sublayers(config: Any, blocks: int) -> int | str:
    """How many attention layers each of ``blocks`` blocks holds (``num_hidden_layers`` counts attention layers:
    LongCat-Flash's blocks hold two), or why that is not a whole number of layers of one type per block."""
    count = config.num_hidden_layers
    if blocks == 0 or count % blocks:
        return f"its {blocks} blocks do not divide num_hidden_layers ({count}) into whole attention layers"
    per_block = count // blocks
    mixed = [i for i in range(blocks) if len({layer_type(config, i * per_block + j) for j in range(per_block)}) > 1]
    if mixed:
        return f"block {mixed[0]} holds attention layers of several types (config.layer_types)"
    return per_block


def block_rotary(model: nn.Module, cut: DecoderCut, index: int) -> tuple[str | None, tuple[str, ...]]:
    """``(the rotary embedding block ``index``'s layer calls, or None; the rotary modules it holds uncalled)``: the
    cut's ``rotary``; with per-layer thetas (:attr:`DecoderCut.rotaries`), the one of ``config.layer_rope_theta
    [index]`` (none for 0), holding the model's global one, which its forward leaves unused."""
    if cut.rotaries is None:
        return cut.rotary, ()
    theta = cast(Any, model).config.layer_rope_theta[index]
    rotaries = cast(nn.ModuleList, model.get_submodule(cut.rotaries))
    own = [i for i, r in enumerate(rotaries) if cast(Any, r).config.rope_parameters["rope_theta"] == theta]
    called = f"{cut.rotaries}.{own[0]}" if theta else None
    return called, tuple(path for path in (cut.rotary,) if path is not None)


def standard_cut(model: PreTrainedModel) -> DecoderCut:
    """The cut of a model of the standard decoder layout (:func:`standard_decoder`)."""
    prefix = model.base_model_prefix
    return DecoderCut(
        f"{prefix}.embed_tokens", None, f"{prefix}.layers", f"{prefix}.rotary_emb", f"{prefix}.norm", "lm_head"
    )


def decoder_layers(model: PreTrainedModel, cut: DecoderCut) -> list[nn.Module]:
    """The backbone layers of a decoder cut at ``cut``: embeddings, one layer per block, final norm, head, with the
    deviations its config declares (see the module docstring).

    Raises:
        UnsupportedModelError: if the model adds a load-balancing loss the adapter cannot carry
            (:func:`router_loss_of`).
    """
    config = model.config
    router = router_loss_of(model)
    hidden_divisor, head = head_scaling(config)
    count = len(cast(nn.ModuleList, model.get_submodule(cut.blocks)))
    per_block = sublayers(config, count)
    assert isinstance(per_block, int)  # the families take only models whose blocks hold whole layers
    blocks = []
    for i in range(count):
        rotary, held = block_rotary(model, cut, i)
        blocks.append(RotaryDecoderBlock(model, f"{cut.blocks}.{i}", rotary, i * per_block, router, held))
    return [
        DecoderEmbedding(
            model,
            cut.embedding,
            dropout=cut.dropout,
            multiplier=own_field(config, "embedding_multiplier"),
            dropout_p=own_field(config, "embedding_dropout"),
            router=router,
            extensions=cut.extensions,
            per_layer=(cut.blocks.rpartition(".")[0], cut.per_layer) if cut.per_layer else None,
            streams=getattr(config, "hc_mult", None) if cut.collapse else None,
            pass_tokens=any(block.tokens for block in blocks),
        ),
        *blocks,
        FinalNorm(model, cut.norm, router, hidden_divisor, cut.collapse),
        Head(model, cut.head, **head),
    ]


def standard_decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the standard decoder layout (:func:`decoder_layers` at
    :func:`standard_cut`)."""
    return decoder_layers(model, standard_cut(model))


def gpt2_layers(model: PreTrainedModel) -> list[nn.Module]:
    """GPT-2's backbone layers: token and position embeddings, one layer per block, ``ln_f``, ``lm_head``."""
    return [
        DecoderEmbedding(model, "transformer.wte", "transformer.wpe", "transformer.drop"),
        *(GPT2Block(model, f"transformer.h.{i}") for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, "transformer.ln_f"),
        Head(model, "lm_head"),
    ]
