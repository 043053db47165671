"""Greedy decoding and beam search through the pipeline, with or without the decoder's key/value cache.

Every step is one backbone call through ``lightning_gpipe.forward_and_share``: the last stage turns the
logits of the newest position into a small result (the next token ids, or the best log-probabilities and
their ids), which every stage receives, so all stages take the same decisions and go round the loop
together. Without a pipeline the same code runs on one device.

With the cache (:class:`Feed` with ``cache=True``) a step feeds only the newest token of each row; each
decoder layer keeps its keys and values (``model.KeyValueCache``), and between steps every stage reorders
the caches of the layers it holds (beam search). Without it, a step feeds the whole prefix and the source
again, re-running the encoder and decoder (the way to check the cache, and to measure what it saves).
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe import forward_and_share
from translation.model import clear_caches, reorder_caches


class Feed:
    """What each decoding step gives the backbone for the target prefix decoded so far.

    Args:
        backbone: the module's backbone (or a pipeline stage's part of it).
        src: ``(N, S)`` long source ids.
        cache: feed only the new tokens and let the decoder layers cache keys and values (``True``), or feed
            the whole source and prefix every step (``False``).
    """

    def __init__(self, backbone: nn.Module, src: Tensor, cache: bool) -> None:
        self.backbone, self.src, self.cache = backbone, src, cache
        if cache:
            clear_caches(backbone)

    def step(self, tgt: Tensor, fn: Callable[[Tensor], Any]) -> Any:
        """Run the backbone on the rows' prefixes ``tgt`` ``(R, T)`` long (``<s>`` first) and return ``fn`` of the
        logits of the last position, ``(R, vocab)``, on every stage."""
        value = (self.src, tgt)
        if self.cache:
            start = tgt.shape[1] - 1
            src = self.src if start == 0 else self.src[:, :0]  # the source once: its keys and values stay cached
            rows = torch.arange(tgt.shape[0], device=tgt.device)
            value = (src, tgt[:, start:], rows, torch.full_like(rows, start))
        return forward_and_share(self.backbone, value, lambda logits: fn(logits[:, -1]))

    def reorder(self, parents: Tensor) -> None:
        """Row ``i`` of the next step continues row ``parents[i]`` ``(R',)`` long of this one."""
        self.src = self.src[parents]
        if self.cache:
            reorder_caches(self.backbone, parents)

    def close(self) -> None:
        """Free the caches."""
        if self.cache:
            clear_caches(self.backbone)


def greedy(
    backbone: nn.Module, src: Tensor, bos: int, eos: int, max_new_tokens: int, cache: bool = True
) -> list[list[int]]:
    """Greedy decoding: every row appends its most likely next token until ``</s>``.

    Args:
        backbone: the module's backbone.
        src: ``(N, S)`` long source ids, target-language token first, padded.
        bos: id of ``<s>``, the first target token.
        eos: id of ``</s>``; a row is finished when it chooses it.
        max_new_tokens: decoding stops after ``S + max_new_tokens`` tokens.
        cache: use the decoder's key/value cache (see :class:`Feed`). Default True.

    Returns:
        N lists of token ids, without ``<s>`` and ``</s>``.
    """
    feed = Feed(backbone, src, cache)
    tgt = torch.full((src.shape[0], 1), bos, dtype=torch.long, device=src.device)
    finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(src.shape[1] + max_new_tokens):
        chosen = feed.step(tgt, lambda logits: logits.argmax(-1).cpu()).to(src.device)
        tgt = torch.cat([tgt, chosen.masked_fill(finished, eos)[:, None]], dim=1)
        finished |= chosen == eos
        if finished.all():
            break
    feed.close()
    return [_until(row, eos) for row in tgt[:, 1:].tolist()]


def length_penalty(length: int, alpha: float) -> float:
    """GNMT's length normalisation ``((5 + length) / 6) ** alpha`` (Wu et al. 2016, arXiv:1609.08144, eq. 14).

    Beam search ranks finished translations by log-probability divided by this, so longer ones are not
    penalised for their extra factors; ``alpha = 0`` ranks by log-probability alone.
    """
    return ((5 + length) / 6) ** alpha


def beam_search(
    backbone: nn.Module,
    src: Tensor,
    bos: int,
    eos: int,
    max_new_tokens: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    cache: bool = True,
) -> list[list[int]]:
    """Beam search with GNMT's length penalty (Wu et al. 2016), finishing hypotheses as fairseq does.

    Each source keeps ``beam_size`` unfinished hypotheses. A step extends each by its ``2 * beam_size`` most
    likely tokens and ranks the candidates by their summed log-probability; a candidate ending in ``</s>``
    among the best ``beam_size`` is finished, scored by its log-probability over :func:`length_penalty`
    of its length (with ``</s>``), and the best ``beam_size`` candidates that do not end in ``</s>`` go on.
    A source is done when it has ``beam_size`` finished hypotheses; after ``S + max_new_tokens`` steps the
    unfinished ones are scored as they are. The best-scoring hypothesis is the translation. With
    ``beam_size = 1`` this is :func:`greedy`. Vaswani et al. 2017 report beam 4 with ``alpha = 0.6``.

    Args:
        backbone: the module's backbone.
        src: ``(N, S)`` long source ids, target-language token first, padded.
        bos: id of ``<s>``.
        eos: id of ``</s>``.
        max_new_tokens: decoding stops after ``S + max_new_tokens`` tokens.
        beam_size: hypotheses kept per source (>= 1). Default 4.
        alpha: the length penalty's exponent. Default 0.6.
        cache: use the decoder's key/value cache (see :class:`Feed`). Default True.

    Returns:
        N lists of token ids, without ``<s>`` and ``</s>``.

    Raises:
        ValueError: when ``beam_size < 1``.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be at least 1")
    n, width = src.shape[0], 2 * beam_size
    feed = Feed(backbone, src, cache)
    tgt = torch.full((n, 1), bos, dtype=torch.long)
    scores = torch.zeros(n, 1)  # summed log-probabilities of each source's unfinished hypotheses
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(n)]
    for step in range(src.shape[1] + max_new_tokens):
        values, tokens = feed.step(tgt.to(src.device), lambda logits: _top(logits, width))
        beams = scores.shape[1]
        candidates = (scores[:, :, None] + values.view(n, beams, width)).view(n, -1)
        ranked, order = candidates.topk(width, dim=1)
        tokens = tokens.view(n, -1).gather(1, order)
        parents = order // width + torch.arange(n)[:, None] * beams  # rows of this step
        for i, j in (tokens[:, :beam_size] == eos).nonzero().tolist():
            if len(finished[i]) < beam_size:
                hypothesis = tgt[parents[i, j], 1:].tolist()
                finished[i].append((ranked[i, j].item() / length_penalty(step + 1, alpha), hypothesis))
        if all(len(done) == beam_size for done in finished):
            break
        going = ranked.masked_fill(tokens == eos, -torch.inf).topk(beam_size, dim=1).indices
        scores = ranked.gather(1, going)
        parents, tokens = parents.gather(1, going).flatten(), tokens.gather(1, going).flatten()
        feed.reorder(parents.to(src.device))
        tgt = torch.cat([tgt[parents], tokens[:, None]], dim=1)
    feed.close()
    length = length_penalty(tgt.shape[1] - 1, alpha)
    best = []
    for i, done in enumerate(finished):
        if len(done) < beam_size:  # out of steps: the unfinished hypotheses compete too
            beams = scores.shape[1]
            done = done + [(scores[i, b].item() / length, tgt[i * beams + b, 1:].tolist()) for b in range(beams)]
        best.append(max(done, key=lambda scored: scored[0])[1])
    return best


def _top(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest log-probabilities of each row of ``(R, vocab)`` logits and their ids, on CPU."""
    values, ids = F.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return values.cpu(), ids.cpu()


def _until(ids: list[int], eos: int) -> list[int]:
    """``ids`` up to (without) the first ``eos``."""
    return ids[: ids.index(eos)] if eos in ids else ids
