"""Generation through the pipeline for an encoder-decoder's backbone (:mod:`lightning_gpipe.hf.seq2seq`): greedy
decoding (:func:`seq2seq_greedy_generate`) and beam search (:func:`seq2seq_beam_search`), every stage calling them
alike.

Each step is one backbone call through :func:`lightning_gpipe.forward_and_share`: the last stage turns the new
position's logits into the step's choice (the next tokens; with beams, also which beams they continue, and the output
once the search is over) and every stage receives it. With the decoder blocks' caches (always for beam search; the
default for greedy) the first step runs the encoder, once, and the decoder on the decoder start; every later step runs
only the decoder on the new tokens, each block reading and extending its own self- and cross-attention caches
(:mod:`lightning_gpipe.hf.seq2seq_cache`), so between decoder stages travel only the new tokens' hidden states. With
beams, every stage then reorders its caches to the beams kept. The first step runs one row per source, its ``K`` beams
being alike; its caches become each source's ``K`` beams' when reordered.

The tokens equal ``model.generate(input_ids, attention_mask=..., do_sample=False, num_beams=..., max_new_tokens=...)``
with the same generation settings: the decoder start, ``forced_bos_token_id`` (the first new token: mBART-50's and
NLLB's target language) and ``forced_eos_token_id`` (the last, at ``max_new_tokens``: BART's, Marian's) through
``transformers``' own logits processors, the end and padding ids, and for beams ``length_penalty`` and
``early_stopping`` (:class:`~lightning_gpipe.hf.beam.BeamSearch`). The generation config's other processors
(``no_repeat_ngram_size``, ``repetition_penalty``, ``min_length``, ``bad_words_ids``...) and sampling are not applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.beam import BeamSearch
from lightning_gpipe.hf.seq2seq_cache import clear_decoder_caches, reorder_decoder_caches
from lightning_gpipe.lightning import forward_and_share

try:
    from transformers import (
        EosTokenCriteria,
        ForcedBOSTokenLogitsProcessor,
        ForcedEOSTokenLogitsProcessor,
        LogitsProcessorList,
        MaxLengthCriteria,
        StoppingCriteriaList,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

Choice = Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None, Tensor | None]]
"""The last stage's choice at each step: ``(logits (R, V) of the new position, decoder ids so far (R, t))`` to
``(next tokens (R',), parents (R',) or None, output or None)``: the rows of this step each next row continues (``None``:
row ``r`` continues row ``r``), and the result once decoding is over."""


DEFAULTS = {"num_beams": 1, "length_penalty": 1.0, "early_stopping": False}
"""What ``generate`` takes for these settings when neither its call nor the model's generation config sets them
(``transformers`` 5.24: ``GenerationConfig._get_default_generation_params``)."""


def generation_setting(generation_config: Any, name: str, given: Any = None) -> Any:
    """The value of setting ``name`` (a key of :data:`DEFAULTS`) as ``generate`` resolves it: ``given`` unless
    ``None``, else the generation config's unless ``None``, else the default."""
    for value in (given, getattr(generation_config, name, None)):
        if value is not None:
            return value
    return DEFAULTS[name]


def _ids(token_ids: int | list[int] | None) -> list[int]:
    """A generation config's id or ids as a list (none for ``None``)."""
    return [] if token_ids is None else [token_ids] if isinstance(token_ids, int) else list(token_ids)


def logits_processors(
    max_length: int, forced_bos_token_id: int | None, forced_eos_token_id: int | list[int] | None, device: Any
) -> LogitsProcessorList:
    """``transformers``' logits processors of the forced tokens, in ``generate``'s order: ``forced_bos_token_id``
    the only possible first new token, ``forced_eos_token_id`` (one id or several) the only possible tokens at
    ``max_length - 1`` (decoder prompt included), each where given (else ``None``)."""
    processors = LogitsProcessorList()
    if forced_bos_token_id is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(forced_bos_token_id))
    if forced_eos_token_id is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(max_length, forced_eos_token_id, device=device))
    return processors


def _decode(
    backbone: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    decoder_start_token_id: int,
    max_new_tokens: int,
    choose: Choice,
    kv_cache: bool = True,
) -> Tensor:
    """Every stage's decoding loop: at most ``max_new_tokens`` steps, each one backbone call whose new position's
    logits ``choose`` turns into the step's choice on the last stage (:data:`Choice`), received by every stage;
    the decoder blocks' caches reordered to the parents, if any, and cleared before and after. Returns the
    choice's output, or the decoder ids ``(N, 1 + T)`` if it gave none."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    sources, ids = input_ids, torch.full_like(input_ids[:, :1], decoder_start_token_id)
    rows = torch.arange(len(ids), device=ids.device)
    value = (sources, mask, ids, torch.ones_like(ids), *([rows] if kv_cache else []))
    clear_decoder_caches(backbone)
    try:
        for _ in range(max_new_tokens):
            step = lambda logits, ids=ids: choose(logits[:, -1], ids)  # noqa: E731 - on the last stage only
            tokens, parents, output = forward_and_share(backbone, value, step)
            if output is not None:
                return output.to(ids.device)
            if parents is not None:
                parents = parents.to(ids.device)
                reorder_decoder_caches(backbone, parents)
                sources, mask, ids = sources[parents], mask[parents], ids[parents]
            ids = torch.cat([ids, tokens.to(ids.device)[:, None]], dim=1)
            if kv_cache:  # the new tokens; the encoder's output is in the decoder blocks' caches
                rows = torch.arange(len(ids), device=ids.device)
                value = (torch.zeros_like(rows), mask, ids[:, -1:], torch.ones_like(ids), rows)
            else:
                value = (sources, mask, ids, torch.ones_like(ids))
    finally:
        clear_decoder_caches(backbone)
    return ids


@torch.no_grad()
def seq2seq_greedy_generate(
    backbone: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    decoder_start_token_id: int,
    max_new_tokens: int = 20,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | list[int] | None = None,
    kv_cache: bool = True,
) -> Tensor:
    """Greedy decoding of an encoder-decoder backbone through the pipeline (every stage calls it alike; see the
    module docstring): each step the last stage picks each row's most likely next token after the forced-token
    processors, and a row that produced an end id gets ``pad_token_id`` afterwards, stopping once every row has.
    Equals ``model.generate(..., do_sample=False, num_beams=1)`` with the same ids. Without a pipeline it runs on
    one device.

    Args:
        backbone: the encoder-decoder's backbone (``module.backbone``).
        input_ids: ``(N, S)`` long sources.
        attention_mask: ``(N, S)``, 1 for real tokens; ``None``: all real.
        decoder_start_token_id: the decoder's first id.
        max_new_tokens: tokens to add at most. Default 20.
        eos_token_id: the end id (or ids), or ``None`` (default) to always add ``max_new_tokens``.
        pad_token_id: what finished rows get; defaults to the (first) end id.
        forced_bos_token_id: the id forced as the first new token, or ``None``.
        forced_eos_token_id: the id (or ids) forced as the last token when ``max_new_tokens`` is reached, or ``None``.
        kv_cache: decode with the decoder blocks' caches, the encoder run once and one new token per step (default),
            or run the encoder and the decoder over the whole prefix every step (``False``).

    Returns:
        ``(N, 1 + T)`` long: the decoder start and the ``T <= max_new_tokens`` new tokens.
    """
    ends = _ids(eos_token_id)
    end_ids = torch.tensor(ends, dtype=torch.long, device=input_ids.device)
    pad = next(iter(ends), None) if pad_token_id is None else pad_token_id
    processors = logits_processors(1 + max_new_tokens, forced_bos_token_id, forced_eos_token_id, input_ids.device)

    def choose(logits: Tensor, ids: Tensor) -> tuple[Tensor, None, Tensor | None]:
        tokens = processors(cast(torch.LongTensor, ids), logits.to(ids.device, torch.float32)).argmax(-1)
        if ends:
            tokens = tokens.masked_fill(torch.isin(ids[:, 1:], end_ids).any(-1), cast(int, pad))
        longer = torch.cat([ids, tokens[:, None]], dim=1)
        over = longer.shape[1] > max_new_tokens or bool(ends and torch.isin(longer[:, 1:], end_ids).any(-1).all())
        return tokens.cpu(), None, longer.cpu() if over else None

    return _decode(backbone, input_ids, attention_mask, decoder_start_token_id, max_new_tokens, choose, kv_cache)


@torch.no_grad()
def seq2seq_beam_search(
    backbone: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    decoder_start_token_id: int,
    num_beams: int = 4,
    max_new_tokens: int = 20,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    forced_bos_token_id: int | None = None,
    forced_eos_token_id: int | list[int] | None = None,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
) -> Tensor:
    """Beam search of an encoder-decoder backbone through the pipeline (every stage calls it alike; see the module
    docstring): each step the last stage runs the search's bookkeeping (:class:`~lightning_gpipe.hf.beam.BeamSearch`)
    and sends every stage the kept beams' next tokens and the beams they continue, by which each stage reorders its
    decoder blocks' caches. Equals ``model.generate(..., do_sample=False, num_beams=num_beams)`` with the same
    settings. Without a pipeline it runs on one device.

    Args:
        backbone: the encoder-decoder's backbone (``module.backbone``).
        input_ids: ``(N, S)`` long sources.
        attention_mask: ``(N, S)``, 1 for real tokens; ``None``: all real.
        decoder_start_token_id: the decoder's first id.
        num_beams: the beams per source. Default 4.
        max_new_tokens: tokens to add at most. Default 20.
        eos_token_id: the end id (or ids), or ``None`` (default): every hypothesis runs to ``max_new_tokens``.
        pad_token_id: what pads the shorter outputs (see :class:`~lightning_gpipe.hf.beam.BeamSearch`).
        forced_bos_token_id: the id forced as the first new token, or ``None``.
        forced_eos_token_id: the id (or ids) forced as the last token when ``max_new_tokens`` is reached, or ``None``.
        length_penalty: the exponent of the generated length that divides a finished hypothesis's log-probability.
            Default 1.0.
        early_stopping: ``True``, ``False`` (default) or ``"never"``, as ``generate``'s.

    Returns:
        ``(N, 1 + T)`` long: each source's best hypothesis, the decoder start and ``T <= max_new_tokens`` tokens.

    Raises:
        ValueError: from :class:`~lightning_gpipe.hf.beam.BeamSearch` (``num_beams < 1``, a bad ``early_stopping``).
    """
    max_length, ends = 1 + max_new_tokens, _ids(eos_token_id)
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length), *([EosTokenCriteria(ends)] if ends else [])])
    search = BeamSearch(
        torch.full_like(input_ids[:, :1], decoder_start_token_id),
        num_beams,
        max_length,
        ends,
        pad_token_id,
        length_penalty,
        early_stopping,
        logits_processors(max_length, forced_bos_token_id, forced_eos_token_id, input_ids.device),
        criteria,
    )
    choose: Choice = lambda logits, ids: search.step(logits)  # noqa: E731 - the search keeps its own beams
    return _decode(backbone, input_ids, attention_mask, decoder_start_token_id, max_new_tokens, choose)
