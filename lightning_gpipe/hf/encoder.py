"""BERT-style encoders as backbone layers, found by structure (BERT, RoBERTa, XLM-RoBERTa and their kin).

Their masked-LM and sequence-classification classes share a layout: the base model (``model.bert``,
``model.roberta``...) holds ``embeddings``, ``encoder.layer[i]`` and, for BERT's classifier, a ``pooler``; the
other children of the model are the head, applied in order (a masked-LM head on the sequence; a classifier on the
pooled first token, or on the sequence when there is no pooler, as RoBERTa's classification head takes its first
token itself). :func:`standard_encoder` recognises the layout, :func:`standard_encoder_layers` cuts it; the
self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on the user's class before the first step.

Between layers only ``(hidden (N, S, H), attention_mask (N, S))`` travel; each block rebuilds the 4-D
bidirectional mask with ``transformers.masking_utils``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel

try:
    from transformers.masking_utils import create_bidirectional_mask
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


def encoder_input(
    input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """An encoder backbone's input: ``(input_ids, attention_mask, token_type_ids)``, each ``(N, S)`` long (the mask
    all ones and the token types all zeros when ``None``)."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    return input_ids, mask, types


class EncoderEmbedding(HFLayer):
    """An encoder's embeddings: ``(input_ids, attention_mask, token_type_ids)``, each ``(N, S)`` long, to
    ``(hidden (N, S, H), attention_mask)``; positions are the embeddings' own default (``0 .. S-1`` for BERT,
    counted past the padding id for RoBERTa), as the model's forward gives no positions.

    Args:
        model: the model.
        embeddings: path of the embeddings module (``"bert.embeddings"``).
    """

    def __init__(self, model: PreTrainedModel, embeddings: str) -> None:
        super().__init__(model, [embeddings])
        self._embeddings = embeddings

    def forward(self, value: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        input_ids, attention_mask, token_type_ids = value
        return self.part(self._embeddings)(input_ids=input_ids, token_type_ids=token_type_ids), attention_mask


class EncoderBlock(HFLayer):
    """One encoder layer: ``(hidden, attention_mask)`` to the same, with the bidirectional mask rebuilt.

    Args:
        model: the model.
        block: path of the layer (``"bert.encoder.layer.2"``).
    """

    def __init__(self, model: PreTrainedModel, block: str) -> None:
        super().__init__(model, [block])
        self._block = block

    def forward(self, value: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, attention_mask = value
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return self.part(self._block)(hidden, mask), attention_mask


class EncoderHead(HFLayer):
    """An encoder's head: ``(hidden, attention_mask)`` to logits, through the pooler if there is one, then the head
    modules in order: ``(N, S, V)`` for a masked-LM head, ``(N, num_labels)`` for a classifier.

    Args:
        model: the model.
        modules: paths of the head's modules, applied in this order (``["dropout", "classifier"]``, ``["cls"]``).
        pooler: path of the base model's pooler (``"bert.pooler"``), applied first, or ``None``.
    """

    def __init__(self, model: PreTrainedModel, modules: Sequence[str], pooler: str | None = None) -> None:
        super().__init__(model, [p for p in (pooler, *modules) if p is not None])
        self._modules_in_order, self._pooler = tuple(modules), pooler

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        output = value[0] if self._pooler is None else self.part(self._pooler)(value[0])
        for path in self._modules_in_order:
            output = self.part(path)(output)
        return output


def standard_encoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the BERT-style encoder layout (see the module docstring), else why not: the
    base model holds exactly ``embeddings``, ``encoder`` (holding only ``layer``, an ``nn.ModuleList``) and
    optionally ``pooler``; the model has a head besides; the config is not a decoder's."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    prefix, config = model.base_model_prefix, model.config
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or prefix not in children(model):
        return f"it has no base model `{prefix}` among its children"
    inner = {name for name, child in children(base).items() if child is not None}
    if not {"embeddings", "encoder"} <= inner or inner - {"embeddings", "encoder", "pooler"}:
        return f"`{prefix}` holds {sorted(inner)}, not embeddings, encoder (and pooler)"
    # base.encoder: a child module (checked above)
    encoder = {name for name, child in children(cast(nn.Module, base.encoder)).items() if child is not None}
    if encoder != {"layer"} or not isinstance(cast(nn.Module, base.encoder).layer, nn.ModuleList):
        return f"`{prefix}.encoder` holds {sorted(encoder)}, not only the nn.ModuleList `layer`"
    if config.is_decoder or getattr(config, "add_cross_attention", False):
        return "is_decoder=True or add_cross_attention=True: only bidirectional encoders are pipelined this way"
    if not _head(model):
        return "it has no head besides the base model"
    return None


def _head(model: PreTrainedModel) -> list[str]:
    return [name for name, child in children(model).items() if child is not None and name != model.base_model_prefix]


def standard_encoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the encoder layout: embeddings, one layer per block, the head."""
    prefix = model.base_model_prefix
    base = getattr(model, prefix)
    blocks = [EncoderBlock(model, f"{prefix}.encoder.layer.{i}") for i in range(len(base.encoder.layer))]
    pooler = f"{prefix}.pooler" if getattr(base, "pooler", None) is not None else None
    return [EncoderEmbedding(model, f"{prefix}.embeddings"), *blocks, EncoderHead(model, _head(model), pooler)]
