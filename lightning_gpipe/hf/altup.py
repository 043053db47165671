"""Alternating updates (AltUp, Baykal et al. 2023, arXiv:2301.13310) of a decoder: Gemma 3n's base model widens
its embeddings into ``config.altup_num_inputs`` predictions before its blocks, every block takes and gives the stack
of them, and it narrows the stack back to one hidden state before its final norm.

Recognised by structure (:func:`altup_children`): a config declaring ``altup_num_inputs`` and a base model holding
two ``nn.ModuleList`` of ``altup_num_inputs - 1`` modules each, the one its forward names before its blocks widening
(Gemma 3n's ``altup_projections``), the one named after them narrowing (``altup_unembed_projections``). The embedding
layer widens (:func:`expand`), each block's layer gives its block the stack as the model's forward does
(:func:`to_block`, :func:`from_block`), the final norm's layer narrows (:func:`collapse`): the arithmetic of the
model's forward, step for step. The self-check proves the reading on a miniature.

Between layers the stack travels as ``(N, S, n, H)`` (the batch in dim 0, as every value between layers); the model's
forward and its blocks hold it as ``(n, N, S, H)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.decoder_layout import forward_names


def altup_children(config: Any, base: nn.Module, blocks: str = "layers") -> tuple[str, str] | None:
    """``(widening, narrowing)``: the names of ``base``'s children that widen the embeddings into
    ``config.altup_num_inputs`` predictions and narrow them back (see the module docstring), or ``None`` where
    ``config`` declares no AltUp or ``base`` holds no such pair (its forward naming one before its ``blocks`` and one
    after, read from the names its code uses)."""
    count = getattr(config, "altup_num_inputs", None)
    if not isinstance(count, int) or count < 2:
        return None
    lists = [
        name
        for name, child in children(base).items()
        if isinstance(child, nn.ModuleList) and name != blocks and len(child) == count - 1
    ]
    names = forward_names(base)
    if len(lists) != 2 or blocks not in names or not set(lists) <= set(names):
        return None
    before = [name for name in lists if names.index(name) < names.index(blocks)]
    after = [name for name in lists if names.index(name) > names.index(blocks)]
    return (before[0], after[0]) if len(before) == len(after) == 1 else None


def _rescaled(projected: Tensor, like: Tensor, target: Tensor) -> Tensor:
    """``projected`` in ``like``'s dtype, rescaled to the root-mean-square ``target`` as the model's forward does
    (its own root-mean-square clamped below at ``1e-5`` before the square root)."""
    projected = projected.to(dtype=like.dtype, device=target.device)
    magnitude = torch.sqrt(torch.mean(projected**2, dim=-1, keepdim=True).clamp(min=1e-5))
    return projected * target / magnitude


def expand(projections: nn.ModuleList, hidden: Tensor) -> Tensor:
    """The embeddings ``hidden`` ``(N, S, H)`` widened into the stack ``(N, S, n, H)`` of ``n = len(projections) +
    1`` predictions: ``hidden`` first, then each projection of it rescaled to ``hidden``'s root-mean-square (Gemma
    3n's forward before its blocks)."""
    target = torch.mean(hidden**2, dim=-1, keepdim=True) ** 0.5
    return torch.stack([hidden, *(_rescaled(project(hidden), hidden, target) for project in projections)], dim=2)


def collapse(projections: nn.ModuleList, stack: Tensor) -> Tensor:
    """The stack ``(N, S, n, H)`` narrowed to ``(N, S, H)``: its first prediction and each other one projected
    (``projections[i - 1]``) and rescaled to the first's root-mean-square, averaged (Gemma 3n's forward after its
    blocks, before its final norm)."""
    predictions = to_block(stack)
    first = predictions[0]
    target = torch.mean(first**2, dim=-1, keepdim=True) ** 0.5
    rest = [_rescaled(project(predictions[i + 1]), first, target) for i, project in enumerate(projections)]
    return torch.mean(torch.stack([first, *rest]), dim=0)


def to_block(stack: Tensor) -> Tensor:
    """The stack ``(N, S, n, H)`` as the blocks take it, ``(n, N, S, H)`` (contiguous, as the model's forward
    stacks it)."""
    return stack.permute(2, 0, 1, 3).contiguous()


def from_block(predictions: Tensor) -> Tensor:
    """A block's output ``(n, N, S, H)`` as the stack travels between layers, ``(N, S, n, H)``."""
    return predictions.permute(1, 2, 0, 3).contiguous()
