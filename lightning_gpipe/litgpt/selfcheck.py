"""The proof of the cut before step 1: a miniature of the user's config, cut into backbone layers, must give exactly
the logits of its own ``GPT.forward``, layer by layer (:func:`check_cut`), or the config is refused with the first
layer that differs named (:class:`SelfCheckError`).

The miniature keeps every structural field of the config (norms, MLP class, parallel residual, rotary fraction and
adjustments, query groups, soft-capping, per-layer rope and sliding-window indices...) and shrinks only the sizes
(:func:`miniature`), so the check costs milliseconds whatever the model's size, runs before any stage process starts,
and needs none of the model's weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.litgpt.cut import backbone_layers

try:
    from litgpt.config import Config
    from litgpt.model import GPT
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError('lightning_gpipe.litgpt needs litgpt: pip install "lightning-gpipe[litgpt]"') from error


class SelfCheckError(TypeError):
    """The backbone layers of a config do not compute what its ``GPT.forward`` computes; the message names the config
    and the first layer that differs (a ``TypeError``, as ``lightning_gpipe.hf``'s and ``lightning_gpipe.timm``'s
    self-check errors are: the model is of a kind the adapter does not cut)."""


def miniature(config: Config) -> Config:
    """``config`` with its structure kept and its sizes small: at most 2 layers, head size 8 (its rotary fraction
    kept), width 32, MLPs of 48 (experts' 16), 64 tokens of vocabulary and of context."""
    fields: dict[str, Any] = dict(
        n_layer=min(config.n_layer, 2),
        n_embd=32,
        head_size=8,
        vocab_size=64,
        padded_vocab_size=64,
        block_size=min(config.block_size, 64),
        intermediate_size=48,
        moe_intermediate_size=None if config.moe_intermediate_size is None else 16,
    )
    return dataclasses.replace(config, **fields)


def _reference(model: GPT, ids: Tensor) -> list[Tensor]:
    """What each backbone layer must give for ``ids``: the first block's input, each block's output, the final norm's
    output and the logits of ``model(ids)``, recorded by hooks."""
    seen: list[Tensor] = []
    blocks = list(cast(nn.ModuleList, model.transformer.h))
    hooks = [blocks[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))]
    hooks += [
        m.register_forward_hook(lambda *a: seen.append(a[2]))
        for m in [*blocks, model.get_submodule("transformer.ln_f")]
    ]
    try:
        logits = model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [*seen, logits]


def check_cut(config: Config) -> None:
    """Prove the cut on a :func:`miniature` of ``config``: built on the CPU (seeded, the caller's random state left as
    it was), its backbone layers (:func:`~lightning_gpipe.litgpt.cut.backbone_layers`) applied one after the other
    to 2 rows of 5 tokens must give exactly, layer by layer, what ``GPT.forward`` computes.

    Raises:
        SelfCheckError: naming the config, the first layer that differs and by how much.
    """
    mini = miniature(config)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
        torch.manual_seed(0)
        model = GPT(mini).eval()
        ids = torch.randint(0, mini.vocab_size, (2, 5))
        expected = _reference(model, ids)
        value: Any = ids
        for layer, want in zip(backbone_layers(model), expected):
            value = layer(value)
            if not torch.equal(value, want):
                difference = (value - want).abs().max().item() if value.shape == want.shape else "another shape"
                raise SelfCheckError(
                    f"litgpt's GPT with the config {config.name or type(config).__name__!r} is not cut as its forward"
                    f" computes: the backbone layer holding {', '.join(layer.paths)} gives {difference} away from the"
                    " model's own (checked on a miniature of the config). lightning_gpipe.litgpt does not carry what"
                    " this config changes there; train it without the pipeline, or give `check=False` only if you"
                    " have verified the cut yourself."
                )
