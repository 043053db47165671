"""litgpt's ``GPT`` as the backbone contract: :func:`to_sequential`."""

from __future__ import annotations

import os

from torch import nn

from lightning_gpipe.litgpt.checkpoint import LitCheckpoint
from lightning_gpipe.litgpt.cut import backbone_layers
from lightning_gpipe.litgpt.selfcheck import check_cut

try:
    from litgpt.model import GPT
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError('lightning_gpipe.litgpt needs litgpt: pip install "lightning-gpipe[litgpt]"') from error


def to_sequential(
    model: GPT, checkpoint: str | os.PathLike | LitCheckpoint | None = None, check: bool = True
) -> nn.Sequential:
    """litgpt's ``GPT`` (any config) as an ``nn.Sequential`` backbone, its modules shared, not copied.

    The layers (:mod:`lightning_gpipe.litgpt.cut`): ``transformer.wte``, one per ``transformer.h[i]`` (each
    rebuilding its rope cos/sin and mask, keeping its key/value caches when decoding), ``transformer.ln_f`` and
    ``lm_head``; ``backbone(idx)`` is ``model(idx)``, logits ``(N, S, padded_vocab_size)`` of ids ``(N, S)``. Their
    state-dict names are litgpt's (``3.transformer.h.2.attn.qkv.weight`` for ``transformer.h.2.attn.qkv.weight``).

    A model built on the meta device (``with torch.device("meta"): GPT(config)``) holds no memory: under
    ``GPipeStrategy`` each stage allocates only its own layers and fills them from ``checkpoint`` (reading only their
    tensors) or initialises them as litgpt's modules do. A model with its weights loads ``checkpoint`` at once.

    Args:
        model: the ``litgpt.model.GPT``.
        checkpoint: a ``lit_model.pth``, a litgpt checkpoint directory holding one, or a :class:`LitCheckpoint`;
            ``None`` (default) for none.
        check: prove the cut first on a miniature of ``model.config`` (default,
            :func:`~lightning_gpipe.litgpt.selfcheck.check_cut`); ``False`` only for a config you have verified.

    Raises:
        SelfCheckError: if the layers do not compute what the config's ``GPT.forward`` computes.
        FileNotFoundError, KeyError, ValueError: for a checkpoint that is not there or not of this config.
    """
    if check:
        check_cut(model.config)
    layers = backbone_layers(model)
    if checkpoint is not None:
        weights = checkpoint if isinstance(checkpoint, LitCheckpoint) else LitCheckpoint(checkpoint)
        for layer in layers:
            layer.weights = weights
            if not any(t.is_meta for t in layer.state_dict().values()):
                layer.load_weights()
    return nn.Sequential(*layers)
