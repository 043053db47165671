"""Greedy decoding of a litgpt backbone through the pipeline, with each stage's blocks keeping their own key/value
caches (:class:`~lightning_gpipe.litgpt.cut.Block`): :func:`greedy_generate`, which equals litgpt's own ``generate``
at ``temperature=0`` (or ``top_k=1``) token for token; :func:`prepare_kv_caches` and :func:`clear_kv_caches` around
it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_gpipe.lightning import forward_and_share
from lightning_gpipe.litgpt.cut import Block


def prepare_kv_caches(backbone: nn.Module, length: int | None) -> None:
    """Empty the key/value caches of ``backbone``'s blocks (those this process holds) and set the positions a new one
    holds, ``length`` (``None``: no cached decoding until set again)."""
    for module in backbone.modules():
        if isinstance(module, Block):
            module.kv_cache, module.cache_length = {}, length


def clear_kv_caches(backbone: nn.Module) -> None:
    """Free the key/value caches of ``backbone``'s blocks (those this process holds)."""
    prepare_kv_caches(backbone, None)


@torch.no_grad()
def greedy_generate(
    backbone: nn.Module, prompts: Tensor, max_new_tokens: int = 20, eos_id: int | None = None
) -> Tensor:
    """Greedy continuations of ``prompts`` through a litgpt backbone (:func:`~lightning_gpipe.litgpt.to_sequential`'s,
    pipelined or not); every stage calls it alike.

    The first step runs the whole prompts, every later one only each row's new token: each block keeps the keys and
    values of its rows in litgpt's ``KVCache`` (see :class:`~lightning_gpipe.litgpt.cut.Block`), so between stages
    only the new token's hidden state ``(n, 1, E)``, its position and the rows travel. Each step is one backbone call
    through :func:`lightning_gpipe.forward_and_share`: the last stage picks each row's most likely next token and
    every stage receives the ids, so all stages go round the loop together.

    Each row equals ``litgpt.generate.base.generate(model, prompt, len(prompt) + max_new_tokens, temperature=0,
    eos_id=eos_id)`` on that prompt alone (after ``model.set_kv_cache(batch_size=1)``), up to where it ends.

    Args:
        backbone: the backbone (``module.backbone``).
        prompts: ``(N, S)`` long, prompts of one length (litgpt's ``generate`` pads none).
        max_new_tokens: tokens to add at most. Default 20.
        eos_id: the end-of-sequence id, or ``None`` (default) to always add ``max_new_tokens``. A row that produced
            it gets it again afterwards, and decoding stops once every row has.

    Returns:
        ``(N, S + T)`` long: the prompts and the ``T <= max_new_tokens`` new tokens.
    """
    rows_count, length = prompts.shape
    rows = torch.arange(rows_count, device=prompts.device)
    value = (prompts, torch.arange(length, device=prompts.device).expand(rows_count, -1), rows)
    ids, finished = prompts, torch.zeros(rows_count, dtype=torch.bool, device=prompts.device)
    prepare_kv_caches(backbone, length + max_new_tokens)
    try:
        for step in range(max_new_tokens):
            chosen = forward_and_share(backbone, value, _next_tokens).to(prompts.device)
            if eos_id is not None:
                chosen = chosen.masked_fill(finished, eos_id)
                finished |= chosen == eos_id
            ids = torch.cat([ids, chosen[:, None]], dim=1)
            if eos_id is not None and bool(finished.all()):
                break
            value = (chosen[:, None], torch.full_like(chosen[:, None], length + step), rows)
    finally:
        clear_kv_caches(backbone)
    return ids


def _next_tokens(logits: Tensor | tuple[Tensor, ...]) -> Tensor:
    """Each row's most likely next token of ``(N, S, V)`` logits (the head's output, a tensor), ``(N,)`` long on the
    CPU (the first of ties, as litgpt's ``sample`` at temperature 0)."""
    assert isinstance(logits, Tensor)
    return logits[:, -1].argmax(-1).cpu()
