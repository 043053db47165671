"""An encoder-decoder's key/value caches in cached decoding through the pipeline: each decoder block's own
(:class:`DecoderCaches`), reordered to the beams a beam search keeps (:func:`reorder_decoder_caches`), emptied by
:func:`clear_decoder_caches`; and the stand-in cache that tells a decoder stack's embeddings how many positions came
before (:func:`past_length_cache`).

A decoder block keeps one ``transformers.EncoderDecoderCache`` per set of rows (one per micro-batch: a pipeline splits
each decoding step of a batch into the same micro-batches), in which the model's own attention appends the new
tokens' self-attention keys and values and, at the first step, stores the cross-attention's keys and values of the
encoder's output, read at every later step (as the model's ``generate`` uses it). Between steps a beam search reorders
the rows (each kept beam continues one of the step's beams, possibly held in another micro-batch; after the first
step each source's row becomes its beams' rows): the caches are then gathered into one whole-batch cache in the new
order, from which each micro-batch of the next step takes its rows. Source: ``transformers`` 5.24
``cache_utils.EncoderDecoderCache`` and ``GenerationMixin._beam_search`` (its ``reorder_cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

try:
    from transformers import DynamicCache, EncoderDecoderCache
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


class DecoderCaches:
    """A decoder block's caches in cached decoding: ``{rows: EncoderDecoderCache}``, and the whole batch's cache a
    reorder left for the next step's micro-batches to take their rows from.

    Args:
        layer_index: the block's index in its stack (its attention's ``layer_idx``, under which the caches hold its
            keys and values).
    """

    def __init__(self, layer_index: int) -> None:
        self.layer_index = layer_index
        self.by_rows: dict[tuple[int, ...], EncoderDecoderCache] = {}
        self._whole: EncoderDecoderCache | None = None
        self._untaken = 0

    def of(self, rows: Tensor, past: int) -> EncoderDecoderCache:
        """The cache of ``rows`` (``(n,)`` long, the batch's rows these are) holding ``past`` positions: a new one
        at the first step (``past == 0``), else the one this block filled (or a reorder left) for them.

        Raises:
            RuntimeError: if this block holds another number of cached positions for these rows (caches cleared, or
                the batch split differently, mid-decoding).
        """
        key = tuple(rows.tolist())
        cache = self.by_rows.get(key)
        if cache is None and self._whole is not None:
            cache = self.by_rows[key] = self._take(rows)
        if cache is None and past == 0:
            cache = self.by_rows[key] = EncoderDecoderCache(DynamicCache(), DynamicCache())
        seen = None if cache is None else cache.get_seq_length(self.layer_index)
        if seen != past:
            raise RuntimeError(
                f"Decoder block {self.layer_index} holds {seen or 0} cached positions for rows {list(key)} but the"
                f" target mask says {past} came before: start cached decoding with the whole decoder prefix, feed each"
                " later step the new tokens of the same rows (every step split alike), and call"
                " `clear_decoder_caches(backbone)` between generations."
            )
        return cast(EncoderDecoderCache, cache)

    def _take(self, rows: Tensor) -> EncoderDecoderCache:
        """Rows ``rows`` of the whole-batch cache a reorder left, which is dropped once every row is taken."""
        whole = cast(EncoderDecoderCache, self._whole)
        self._untaken -= len(rows)
        if self._untaken <= 0:
            self._whole = None
        return _gathered([whole], rows)

    def reorder(self, parents: Tensor) -> None:
        """Make row ``r`` of the next step continue row ``parents[r]`` of this one (``(R,)`` long; ``R`` may exceed
        this step's rows: a beam search's first step, each source's row becoming its beams'). A single micro-batch
        of the same rows is reordered in place (the cache's own ``reorder_cache``, as ``generate`` reorders it);
        otherwise the caches are gathered into one whole-batch cache in the new order, from which the next step's
        micro-batches take their rows (:meth:`of`)."""
        keys = list(self.by_rows)
        if not keys:
            return
        rows = [row for key in keys for row in key]
        position = torch.empty(max(rows) + 1, dtype=torch.long)
        position[torch.tensor(rows)] = torch.arange(len(rows))
        index = position[parents.cpu()]
        if len(keys) == 1 and keys[0] == tuple(range(len(parents))):
            self.by_rows[keys[0]].reorder_cache(cast(torch.LongTensor, index))
            return
        self._whole = _gathered([self.by_rows[key] for key in keys], index)
        self.by_rows, self._untaken = {}, len(parents)

    def clear(self) -> None:
        """Drop every cache (the end of a generation)."""
        self.by_rows, self._whole, self._untaken = {}, None, 0


def _gathered(caches: Sequence[EncoderDecoderCache], index: Tensor) -> EncoderDecoderCache:
    """A new cache of rows ``index`` of ``caches``' rows laid end to end: every layer's self- and cross-attention keys
    and values (``(rows, heads, positions, head_dim)``) concatenated and indexed in dim 0; layers not filled stay
    empty."""

    def rows_of(parts: tuple) -> Tensor | None:
        first = parts[0]
        if first is None or first.dim() == 0:  # a layer not filled, or a sliding window's size
            return first
        whole = first if len(parts) == 1 else torch.cat(parts)
        return whole.index_select(0, index.to(whole.device))

    layers = [tuple(rows_of(parts) for parts in zip(*items)) for items in zip(*caches)]
    return EncoderDecoderCache(layers)


def decoder_caches(backbone: nn.Module) -> list[DecoderCaches]:
    """The :class:`DecoderCaches` of ``backbone``'s decoder blocks (those this process holds)."""
    found = [getattr(module, "decoder_caches", None) for module in backbone.modules()]
    return [caches for caches in found if isinstance(caches, DecoderCaches)]


def reorder_decoder_caches(backbone: nn.Module, parents: Tensor) -> None:
    """:meth:`DecoderCaches.reorder` of every decoder block ``backbone`` holds: row ``r`` of the next step continues
    row ``parents[r]`` (``(R,)`` long) of this one."""
    for caches in decoder_caches(backbone):
        caches.reorder(parents)


def clear_decoder_caches(backbone: nn.Module) -> None:
    """Empty the caches of ``backbone``'s decoder blocks (those this process holds), freeing them."""
    for caches in decoder_caches(backbone):
        caches.clear()


def past_length_cache(past: int, like: Tensor) -> EncoderDecoderCache:
    """A cache that holds nothing of use but says ``past`` positions came before (its ``get_seq_length()``): what
    a decoder stack's ``forward`` reads, before its first block, to number the new tokens' positions (BART's learned
    ones, Marian's and M2M100's sinusoidal ones) and size its mask, as under ``generate``. Its one self-attention layer
    holds ``(1, 1, past, 1)`` zeros of ``like``'s dtype and device."""
    keys = like.new_zeros((1, 1, past, 1))
    return EncoderDecoderCache(DynamicCache([(keys, keys)]), DynamicCache())
