"""Beam search's bookkeeping, one decoding step at a time (:class:`BeamSearch`): from the next-token logits of every
running beam, the beams kept, the finished hypotheses and whether the search is over.

It is ``transformers`` 5.24's vectorised beam search (``GenerationMixin._beam_search`` and its helpers
``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``, ``_update_finished_beams``,
``_check_early_stop_heuristic``, ``_beam_search_has_unfinished_sequences``: private methods, so not called here) step
by step, with the same operations in the same order, so that its tokens equal ``model.generate(num_beams=K, ...)``'s:
log-softmax of the logits, the logits processors, the ``(1 + ends) * K`` best continuations of each source over all its
beams, the ``K`` best that did not stop continuing, the stopped ones among the first ``K`` scored with
``length_penalty`` and merged into the ``K`` best finished hypotheses, ``early_stopping`` (``True``, ``False`` or
``"never"``) and its heuristic, and the output: each source's best hypothesis, all cropped to the longest and padded as
``generate`` pads them. What it keeps instead of ``generate``'s per-step beam indices: each hypothesis's generated
length (the same crop) and the beams this step continued (what each stage reorders its caches by). Beam search:
Graves (2012, arXiv:1211.3711); its length penalty: Wu et al. (2016, arXiv:1609.08144).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn


class BeamStep(NamedTuple):
    """What one step decided, sent from the last stage to every stage (a tuple, as greedy decoding's steps).

    Attributes:
        tokens: ``(B * K,)`` long, the next token of every kept beam (source ``b``'s beams are rows ``b * K`` to
            ``b * K + K - 1``).
        parents: ``(B * K,)`` long, the row of this step's input each kept beam continues (at the first step, whose
            input is one row per source, the source's row).
        output: ``(B, 1 + T)`` long, each source's best hypothesis, once the search is over; else ``None``.
    """

    tokens: Tensor
    parents: Tensor
    output: Tensor | None


def _gather(tensor: Tensor, indices: Tensor) -> Tensor:
    """``tensor`` ``(B, beams, ...)`` at ``indices`` ``(B, k)`` of dim 1: ``(B, k, ...)``."""
    while indices.dim() < tensor.dim():
        indices = indices.unsqueeze(-1)
    return torch.take_along_dim(tensor, indices, dim=1)


class BeamSearch:
    """Beam search's state and step (see the module docstring), on the device of ``prompt``.

    Args:
        prompt: ``(B, P)`` long, each source's decoder prompt (its decoder start token).
        num_beams: ``K``, the beams per source.
        max_length: the longest hypothesis, prompt included (``P + max_new_tokens``).
        eos_token_id: the end ids (none: every hypothesis runs to ``max_length``).
        pad_token_id: the padding id, or ``None``; the output's shorter hypotheses are padded with it if it is set
            and not 0, else with the first end id (``-1`` without end ids), as ``generate`` pads them.
        length_penalty: a finished hypothesis's score is its log-probability over its generated length to this power.
        early_stopping: ``True`` (stop a source once it has ``K`` finished hypotheses), ``False`` (stop once its best
            running beam, over its current length, cannot beat its worst finished one) or ``"never"`` (stop when no
            running beam can, over the longest length when ``length_penalty > 0``).
        processors: the logits processors (``transformers.LogitsProcessorList``), applied to the log-probabilities
            with the running beams' ids ``(B * K, length)``.
        criteria: the stopping criteria (``transformers.StoppingCriteriaList``: the maximum length, the end ids).

    Raises:
        ValueError: for ``num_beams < 1`` or ``early_stopping`` other than ``True``, ``False`` or ``"never"``.
    """

    def __init__(
        self,
        prompt: Tensor,
        num_beams: int,
        max_length: int,
        eos_token_id: list[int],
        pad_token_id: int | None,
        length_penalty: float,
        early_stopping: bool | str,
        processors: Callable[[Any, Tensor], Tensor],
        criteria: Callable[[Tensor, Any], Tensor],
    ) -> None:
        if num_beams < 1 or early_stopping not in (True, False, "never"):
            raise ValueError(f"num_beams={num_beams}, early_stopping={early_stopping!r}: give num_beams >= 1 and"
                             " early_stopping True, False or 'never'.")  # fmt: skip
        batch, self.prompt = prompt.shape
        self.num_beams, self.max_length, self.length = num_beams, max_length, self.prompt
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.processors, self.criteria = processors, criteria
        self.keep = max(2, 1 + len(eos_token_id)) * num_beams
        self.first_beams = torch.arange(self.keep, device=prompt.device) < num_beams
        fill = (pad_token_id or eos_token_id[0]) if eos_token_id else -1
        self.running = prompt.new_full((batch, num_beams, max_length), fill)
        self.running[:, :, : self.prompt] = prompt[:, None]
        self.sequences = self.running.clone()
        self.running_scores = torch.zeros((batch, num_beams), device=prompt.device)
        self.running_scores[:, 1:] = -1e9
        self.scores = torch.full((batch, num_beams), -1e9, device=prompt.device)
        self.lengths = torch.zeros((batch, num_beams), dtype=torch.long, device=prompt.device)
        self.finished = torch.zeros((batch, num_beams), dtype=torch.bool, device=prompt.device)
        self.improvable = torch.ones((batch, 1), dtype=torch.bool, device=prompt.device)

    def step(self, logits: Tensor) -> BeamStep:
        """One step from the next-token ``logits`` ``(B * K, V)`` of the running beams (or ``(B, V)``, one row per
        source, at the first step: its beams are alike).

        Returns:
            the :class:`BeamStep`, ``tokens`` and ``parents`` on the CPU.
        """
        batch, beams = self.running.shape[:2]
        log_probs = nn.functional.log_softmax(logits.to(self.running.device, torch.float32), dim=-1)
        if log_probs.shape[0] == batch and beams > 1:
            log_probs = log_probs.repeat_interleave(beams, dim=0)
        log_probs = self.processors(self.running[:, :, : self.length].reshape(batch * beams, -1), log_probs)
        vocabulary = log_probs.shape[-1]
        log_probs = log_probs.reshape(batch, beams, vocabulary) + self.running_scores[:, :, None]
        top_scores, top = torch.topk(log_probs.reshape(batch, -1), k=self.keep)
        from_beam = top // vocabulary
        candidates = _gather(self.running, from_beam)
        candidates[:, :, self.length] = top % vocabulary
        stopped = self.criteria(candidates[:, :, : self.length + 1].reshape(batch * self.keep, -1), None)
        stopped = stopped.reshape(batch, self.keep)
        running_scores = top_scores + stopped.to(torch.float32) * -1.0e9
        best = torch.topk(running_scores, k=beams)[1]
        self.running, self.running_scores = _gather(candidates, best), _gather(running_scores, best)
        offset = torch.arange(batch, device=top.device)[:, None] * beams
        parents = _gather(from_beam + offset, best).reshape(-1)
        self._finish(candidates, top_scores, stopped)
        self.length += 1
        self._check_improvable()
        over = not bool(self.improvable.any()) or bool(stopped.all())
        over = over or (self.early_stopping is True and bool(self.finished.all()))
        tokens = self.running[:, :, self.length - 1].reshape(-1)
        parents = parents if logits.shape[0] == batch * beams else parents // beams
        return BeamStep(tokens.cpu(), parents.cpu(), self.output() if over else None)

    def _finish(self, candidates: Tensor, top_scores: Tensor, stopped: Tensor) -> None:
        """Merge the candidates that stopped among the first ``K`` (scored with the length penalty) into the ``K``
        best finished hypotheses (``generate``'s ``_update_finished_beams``)."""
        just_finished = stopped & self.first_beams[None, :]
        generated = self.length + 1 - self.prompt
        scores = top_scores / (generated**self.length_penalty)
        full = torch.all(self.finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        scores += full.to(torch.float32) * -1.0e9
        scores += (~self.improvable).to(torch.float32) * -1.0e9
        scores += (~just_finished) * -1.0e9
        merged_scores = torch.cat((self.scores, scores), dim=1)
        best = torch.topk(merged_scores, k=self.num_beams)[1]
        self.sequences = _gather(torch.cat((self.sequences, candidates), dim=1), best)
        self.scores = _gather(merged_scores, best)
        lengths = torch.full_like(top_scores, generated, dtype=torch.long)
        self.lengths = _gather(torch.cat((self.lengths, lengths), dim=1), best)
        self.finished = _gather(torch.cat((self.finished, just_finished), dim=1), best)

    def _check_improvable(self) -> None:
        """Whether each source's best running beam may still beat its worst finished hypothesis (``generate``'s
        ``_check_early_stop_heuristic``)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_length - self.prompt
        else:
            length = self.length - self.prompt
        best_possible = self.running_scores[:, :1] / (length**self.length_penalty)
        worst = torch.where(self.finished, torch.min(self.scores, dim=1, keepdim=True)[0], -1.0e9)
        self.improvable = self.improvable & torch.any(best_possible > worst, dim=-1, keepdim=True)

    def output(self) -> Tensor:
        """``(B, P + T)`` long on the CPU: each source's best finished hypothesis, cropped to the longest one's
        length ``P + T``."""
        return self.sequences[:, 0, : self.prompt + int(self.lengths[:, 0].max())].cpu()
