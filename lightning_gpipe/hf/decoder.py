"""Decoders as backbone layers: the standard layout of ``transformers`` 5 (found by structure) and GPT-2.

``transformers`` 5 builds most causal LMs alike (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
``MixtralForCausalLM``...): ``model.embed_tokens``, the blocks ``model.layers[i]`` called with the hidden states,
the rotary cos/sin, the 4-D mask and the cache, ``model.norm``, ``model.rotary_emb`` and ``lm_head``.
:func:`standard_decoder` recognises that layout from the modules and the config (not the class name) and
:func:`standard_decoder_layers` cuts it, handling the deviations the config declares: a multiplier on the embeddings
(Granite's ``embedding_multiplier``) or a dropout on them (StarCoder 2's ``embedding_dropout``), logits scaled
(``logits_scaling``, ``logit_scale``) or soft-capped (``final_logit_softcapping``), attention by layer type
(``layer_types``: full or sliding window, each with its own rotary table where the rotary module takes a
``layer_type``), and mixture-of-experts routers whose load-balancing loss travels as per-row statistics
(:mod:`lightning_gpipe.hf.moe`). Whatever else a class does differently is caught by the self-check
(:mod:`lightning_gpipe.hf.selfcheck`) before the first step.

Between layers only tensors travel, each with the batch in dim 0: ``(hidden (N, S, H), attention_mask (N, S),
position_ids (N, S)[, router statistics (N, 2E + 1)][, rows (n,)])``. Each block rebuilds what the model's forward
builds once for all blocks (the 4-D mask with ``transformers.masking_utils``, the rotary cos/sin from the positions)
and calls the block as the model's forward does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel
from lightning_gpipe.hf.moe import RouterLoss, router_loss_of

try:
    from transformers import DynamicCache
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

MASKS: dict[str, Callable[..., Any]] = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
}
"""The attention mask helper of each layer type the adapter rebuilds (``config.layer_types``)."""


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids ``(N, S)`` long of a padded batch: each row counts its real tokens from 0 (padding gets 0).

    As ``generate`` numbers left-padded prompts; for right padding or none it equals ``arange(S)`` on the real
    tokens, as the model's ``forward`` numbers them when given no positions.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(attention_mask == 0, 0)


def decoder_input(input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder backbone's input for a training or evaluation batch: ``(input_ids, attention_mask, position_ids)``,
    each ``(N, S)`` long, positions ``0 .. S-1`` as the model's forward numbers a batch given no positions (the mask
    all ones when ``None``)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1).contiguous()
    return input_ids, mask, positions


def causal_lm_loss(output: Tensor | tuple[Tensor, Tensor], labels: Tensor, router: RouterLoss | None) -> Tensor:
    """A causal LM's loss from its backbone's output, as the model's forward computes it with ``labels``.

    Next-token cross-entropy over the labelled tokens (``ForCausalLMLoss``: ``labels`` ``(N, S)`` long, ``-100``
    where no loss is wanted), plus ``router.coefficient`` times the load-balancing loss of the router statistics
    when the output is ``(logits (N, S, V), statistics (N, 2E + 1))`` (a mixture of experts with
    ``output_router_logits=True``, see :mod:`lightning_gpipe.hf.moe`).
    """
    logits, statistics = output if isinstance(output, tuple) else (output, None)
    loss = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])
    if statistics is not None and router is not None:
        loss = loss + router.coefficient * router.aux_loss(statistics)
    return loss


def _unpack(value: tuple[Tensor, ...], router: RouterLoss | None):
    """``(hidden, attention_mask, position_ids, statistics or None, rows or None)`` of a decoder value."""
    hidden, attention_mask, position_ids, *rest = value
    statistics = rest.pop(0) if router is not None else None
    return hidden, attention_mask, position_ids, statistics, rest[0] if rest else None


def _pack(*items: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(item for item in items if item is not None)


class DecoderEmbedding(HFLayer):
    """Token (and learned position) embeddings of a decoder: ``(input_ids, attention_mask, position_ids[, rows])``,
    each ``(N, S)`` long (rows ``(n,)``, see :class:`CachedDecoderBlock`), to ``(hidden (N, S, H), attention_mask,
    position_ids[, statistics][, rows])``.

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
    ) -> None:
        super().__init__(model, [p for p in (tokens, positions, dropout) if p is not None])
        self._tokens, self._positions, self._dropout = tokens, positions, dropout
        self.multiplier, self.dropout_p, self.router = multiplier, dropout_p, router

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, attention_mask, position_ids, *rows = value
        hidden = self.part(self._tokens)(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self._positions is not None:
            hidden = hidden + self.part(self._positions)(position_ids).to(hidden.device)
        if self._dropout is not None:
            hidden = self.part(self._dropout)(hidden)
        if self.dropout_p is not None:
            hidden = nn.functional.dropout(hidden, p=self.dropout_p, training=self.training)
        statistics = None
        if self.router is not None:
            statistics = torch.zeros(input_ids.shape[0], self.router.width, device=hidden.device)
        return _pack(hidden, attention_mask, position_ids, statistics, *rows)


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
        self._mask = MASKS[self.layer_type]
        self.kv_cache: dict[tuple[int, ...], Any] = {}

    def cache_and_mask(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor, rows: Tensor | None):
        """The cache of ``rows`` (``None`` without rows) and the block's 4-D mask against it.

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
        mask = self._mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=self.layer_index,
        )
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
    model's forward does. With router statistics, adds those of the block's routers (:mod:`lightning_gpipe.hf.moe`).
    With ``rows``, decodes incrementally with its own key/value cache (see :class:`CachedDecoderBlock`).

    Args:
        model: the model.
        block: path of the block (``"model.layers.2"``).
        rotary: path of the model's rotary embedding (``"model.rotary_emb"``); held by every block layer (its
            buffers are not saved, so no name is added to the checkpoint).
        layer_index: the block's index in the model (which mask it uses).
        router: see :class:`CachedDecoderBlock`.
    """

    def __init__(
        self, model: PreTrainedModel, block: str, rotary: str, layer_index: int, router: RouterLoss | None = None
    ) -> None:
        super().__init__(model, [block, rotary], layer_index, router)
        self._block, self._rotary = block, rotary
        typed = "layer_type" in inspect.signature(self.part(rotary).forward).parameters
        self._rotary_type = (self.layer_type,) if typed else ()
        self._routers = [] if router is None else router.routers(self.part(block), block)

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, statistics, rows = _unpack(value, self.router)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows)
        cos_sin = self.part(self._rotary)(hidden, position_ids, *self._rotary_type)
        # statistics come with a router only (_unpack)
        recording: AbstractContextManager[list[Tensor]] = (
            cast(RouterLoss, self.router).recording(self._routers) if statistics is not None else nullcontext([])
        )
        with recording as router_logits:
            output = self.part(self._block)(
                hidden,
                attention_mask=mask,
                position_embeddings=cos_sin,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
            )
        for logits in router_logits:
            assert self.router is not None  # router logits are recorded with a router only
            statistics = statistics + self.router.statistics(logits, attention_mask[:, -hidden.shape[1] :])
        return _pack(output, attention_mask, position_ids, statistics, rows)


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
        hidden, attention_mask, position_ids, _, rows = _unpack(value, None)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows)
        hidden = self.part(self._block)(
            hidden, cache, mask, None, use_cache=cache is not None, position_ids=position_ids
        )
        return _pack(hidden, attention_mask, position_ids, rows)


class FinalNorm(HFLayer):
    """The final norm: ``(hidden, ...)`` to the normalised hidden states ``(N, S, H)``, or ``(hidden,
    statistics)`` when the value carries router statistics (the head needs nothing else).

    Args:
        model: the model.
        norm: path of the norm (``"model.norm"``).
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss` when the value carries router statistics,
            else ``None`` (default).
    """

    def __init__(self, model: PreTrainedModel, norm: str, router: RouterLoss | None = None) -> None:
        super().__init__(model, [norm])
        self._norm, self.router = norm, router

    def forward(self, value: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, _, _, statistics, _ = _unpack(value, self.router)
        hidden = self.part(self._norm)(hidden)
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
    """

    def __init__(
        self,
        model: PreTrainedModel,
        head: str,
        multiplier: float | None = None,
        divisor: float | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(model, [head])
        self._head = head
        self.multiplier, self.divisor, self.softcap = multiplier, divisor, softcap

    def forward(self, value: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, *statistics = value if isinstance(value, tuple) else (value,)
        logits = self.part(self._head)(hidden)
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits, *statistics) if statistics else logits


STANDARD_BASE = ("embed_tokens", "layers", "norm", "rotary_emb")
"""The modules of a standard decoder's base model, and nothing else."""


def standard_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the standard decoder layout (see the module docstring), else why not: its
    children must be exactly the base model and ``lm_head``, the base model's exactly :data:`STANDARD_BASE` (the
    blocks an ``nn.ModuleList`` of ``num_hidden_layers``), and every layer type one of :data:`MASKS`."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    prefix, config = model.base_model_prefix, model.config
    children = sorted(name for name, child in model._modules.items() if child is not None)
    base = getattr(model, prefix, None) if prefix else None
    if base is None or children != sorted([prefix, "lm_head"]):
        return f"its children are {children}, not the base model and lm_head"
    inner = sorted(name for name, child in base._modules.items() if child is not None)
    if inner != sorted(STANDARD_BASE):
        return f"`{prefix}` holds {inner}, not exactly {list(STANDARD_BASE)}"
    if not isinstance(base.layers, nn.ModuleList) or len(base.layers) != config.num_hidden_layers:
        return f"`{prefix}.layers` is not an nn.ModuleList of num_hidden_layers blocks"
    unknown = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)} - set(MASKS))
    if unknown:
        return f"layer types {unknown} (supported: {', '.join(MASKS)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (a bidirectional encoder, not a causal LM)"
    return None


def standard_decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the standard decoder layout: embeddings, one layer per block, final norm,
    head, with the deviations its config declares (see the module docstring).

    Raises:
        ValueError: if the config asks for router logits the adapter cannot carry (:func:`router_loss_of`).
    """
    prefix, config = model.base_model_prefix, model.config
    router = router_loss_of(model)
    rotary = f"{prefix}.rotary_emb"
    return [
        DecoderEmbedding(
            model,
            f"{prefix}.embed_tokens",
            multiplier=getattr(config, "embedding_multiplier", None),
            dropout_p=getattr(config, "embedding_dropout", None),
            router=router,
        ),
        *(
            RotaryDecoderBlock(model, f"{prefix}.layers.{i}", rotary, i, router)
            for i in range(config.num_hidden_layers)
        ),
        FinalNorm(model, f"{prefix}.norm", router),
        Head(
            model,
            "lm_head",
            multiplier=getattr(config, "logit_scale", None),
            divisor=getattr(config, "logits_scaling", None),
            softcap=getattr(config, "final_logit_softcapping", None),
        ),
    ]


def gpt2_layers(model: PreTrainedModel) -> list[nn.Module]:
    """GPT-2's backbone layers: token and position embeddings, one layer per block, ``ln_f``, ``lm_head``."""
    return [
        DecoderEmbedding(model, "transformer.wte", "transformer.wpe", "transformer.drop"),
        *(GPT2Block(model, f"transformer.h.{i}") for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, "transformer.ln_f"),
        Head(model, "lm_head"),
    ]
