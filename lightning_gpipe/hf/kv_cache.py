"""Cached decoding through the pipeline: decoder blocks that build their masks and keep their own caches
(:class:`CachedDecoderBlock`, emptied by :func:`clear_kv_caches`), so that only the new tokens' hidden states travel
between stages and each stage holds the caches of its own blocks; the positions of left-padded prompts
(:func:`positions_from_mask`); and whether a backbone call is a decoding step (:func:`decoding`, with or without
caches). :func:`~lightning_gpipe.hf.greedy_generate` drives them.

A block's cache is ``transformers``' ``DynamicCache`` built from the model's config, which holds for each layer type
what the model's own ``generate`` keeps (``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING``): keys and values for attention
layers, the convolution and recurrent states for the recurrent ones (``linear_attention``: Mamba, Mamba-2, Jamba's and
Bamba's Mamba layers; ``conv``: LFM2's short convolutions), both for the hybrid types (``hybrid``: Inkling's blocks).
A block whose modules keep its state on themselves instead (RecurrentGemma's recurrent blocks) keeps each set of rows'
state beside its cache (``module_states``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from torch import Tensor, nn

from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel
from lightning_gpipe.hf.masks import HYBRID, MASKS, forward_layer_type
from lightning_gpipe.hf.moe import RouterLoss
from lightning_gpipe.hf.packing import document_mask

try:
    from transformers import DynamicCache
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids ``(N, S)`` long of a padded batch: each row counts its real tokens from 0 (padding gets 0).

    As ``generate`` numbers left-padded prompts; for right padding or none it equals ``arange(S)`` on the real
    tokens, as the model's ``forward`` numbers them when given no positions.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(attention_mask == 0, 0)


_DECODING: ContextVar[bool] = ContextVar("lightning_gpipe_decoding", default=False)


@contextmanager
def decoding() -> Iterator[None]:
    """Mark every backbone call of this process within as a step of a decoding loop (with or without caches), whose
    positions are :func:`positions_from_mask`'s, as ``generate`` gives them: for a model whose forward numbers the
    positions itself otherwise when given none (RoBERTa's from the padding id up), the embedding layer then gives
    the forward these (:class:`~lightning_gpipe.hf.causal_encoder.CausalEncoderEmbedding`).
    :func:`~lightning_gpipe.hf.greedy_generate` runs within it on every stage (its decorator). :func:`is_decoding`
    reads it."""
    token = _DECODING.set(True)
    try:
        yield
    finally:
        _DECODING.reset(token)


def is_decoding(value: tuple[Tensor, ...]) -> bool:
    """Whether the backbone ``value`` is a decoding step: within :func:`decoding`, or a step of cached decoding
    (``rows`` ``(n,)`` at its end)."""
    return _DECODING.get() or value[-1].dim() == 1


class CachedDecoderBlock(HFLayer):
    """A decoder block that can keep its own cache (keys and values, or a recurrent layer's states) for incremental
    decoding.

    In training and plain evaluation the value is ``(hidden (N, S, H), attention_mask (N, S), position_ids (N,
    S)[, statistics])`` and the block runs without a cache. For cached decoding (see
    :func:`~lightning_gpipe.hf.greedy_generate`) the value ends with one more item, ``rows`` ``(n,)`` long: which
    sequences of the batch these are. ``hidden`` and ``position_ids`` are then only the new tokens ``(n, t)``,
    while ``attention_mask`` ``(n, past + t)`` covers every token so far; the block keeps one
    ``transformers.DynamicCache`` per set of rows (one per micro-batch: a pipeline splits every decoding step of a
    batch alike), in which the model's attention appends the new keys and values (a recurrent layer updates its
    convolution and recurrent states), and builds the 4-D mask against it as the model's forward does; it counts the
    tokens each set of rows has cached itself (a recurrent layer's state does not tell). So only the new tokens'
    hidden states travel between stages, and each stage holds the caches of its own blocks only.
    :func:`clear_kv_caches` empties them.

    Args:
        model: the model.
        paths: the paths of the modules it holds (the block first).
        layer_index: the block's index in the model (its attention's ``layer_idx``, which mask it uses).
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss` when the value carries router statistics,
            else ``None`` (default).

    Attributes:
        kv_cache: ``{rows: DynamicCache}``, the caches of cached decoding (not part of the state dict).
        cached_tokens: ``{rows: int}``, the tokens each cache holds (the attention mask's length so far).
        mask_layer: the layer of the cache the mask is built against: ``layer_index``, or the layer whose keys and
            values the block's layer reuses (:class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock`).
        module_states: ``{rows: {(module index, name): tensor}}``, the state of each set of rows of a block that
            keeps it on its modules rather than in a cache (RecurrentGemma's recurrent blocks:
            :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock`).
    """

    def __init__(
        self, model: PreTrainedModel, paths: list[str], layer_index: int, router: RouterLoss | None = None
    ) -> None:
        super().__init__(model, paths)
        self.layer_index, self.router = layer_index, router
        self.mask_layer = layer_index
        self.layer_type = forward_layer_type(model.config, layer_index, model.get_submodule(paths[0].rsplit(".", 2)[0]))
        attention, recurrent = HYBRID.get(self.layer_type, (self.layer_type, None))
        self._mask = MASKS[attention]
        self._recurrent_mask = None if recurrent is None else MASKS[recurrent]
        self.kv_cache: dict[tuple[int, ...], Any] = {}
        self.cached_tokens: dict[tuple[int, ...], int] = {}
        self.module_states: dict[tuple[int, ...], dict[tuple[int, str], Any]] = {}

    def _cache_of(self, rows: Tensor, past: int, new: int) -> Any:
        """The cache of ``rows``, new when ``past`` is 0, after checking it holds the ``past`` tokens the mask says
        came before; counts the ``new`` ones it is about to take (:attr:`cached_tokens`)."""
        key = tuple(rows.tolist())
        cache = self.kv_cache.get(key)
        if cache is None and past == 0:
            cache = self.kv_cache[key] = DynamicCache(config=self.config)
        seen = None if cache is None else self.cached_tokens.get(key, 0)
        if seen != past:
            raise RuntimeError(
                f"Block {self.layer_index} holds {seen or 0} cached positions for rows {list(key)} but the"
                f" attention mask says {past} came before: start cached decoding with the whole prompts, feed"
                " each later step the new tokens of the same rows (every step split alike), and call"
                " `clear_kv_caches(backbone)` between generations."
            )
        self.cached_tokens[key] = past + new
        return cache

    def cache_and_mask(
        self,
        hidden: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        rows: Tensor | None,
        documents: Tensor | None = None,
    ):
        """The cache of ``rows`` (``None`` without rows) and the block's mask against it; with ``documents`` (packed
        rows, see :func:`~lightning_gpipe.hf.packing.decoder_input`) kept inside each document
        (:func:`~lightning_gpipe.hf.packing.same_document`); for a layer type of
        :data:`~lightning_gpipe.hf.masks.HYBRID`, the mask is ``(attention mask, recurrent mask)``.

        Raises:
            RuntimeError: if ``attention_mask`` covers earlier tokens this block has not cached for these rows
                (caches cleared or the batch split differently mid-decoding).
        """
        cache = None
        if rows is not None:
            cache = self._cache_of(rows, attention_mask.shape[1] - hidden.shape[1], hidden.shape[1])
        arguments = dict(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
            layer_idx=self.mask_layer,
        )
        mask = self._mask(**arguments) if documents is None else document_mask(self._mask, documents, **arguments)
        if self._recurrent_mask is not None:  # a hybrid layer type: (attention mask, recurrent mask)
            mask = (mask, self._recurrent_mask(**arguments))
        return cache, mask


def clear_kv_caches(backbone: nn.Module) -> None:
    """Empty the caches of ``backbone``'s decoder blocks (those this process holds), freeing them."""
    for module in backbone.modules():
        if isinstance(module, CachedDecoderBlock):
            module.kv_cache, module.cached_tokens, module.module_states = {}, {}, {}
