"""Hugging Face ``transformers`` models in the pipeline (``lightning_gpipe.hf``).

:func:`to_sequential` turns a loaded model (a decoder cut where its declared pipeline plan says, or of ``transformers``
5's standard layout, GPT-2, BERT-style encoders, encoder-decoders, a ``peft`` LoRA model of one) into the backbone
contract without copying weights, after proving its cut on a miniature of the same class (the self-check);
:class:`~lightning_gpipe.hf.module.CausalLM`, :class:`~lightning_gpipe.hf.module.Seq2SeqLM` (encoder-decoders: T5,
BART, Marian, M2M100...), :class:`~lightning_gpipe.hf.module.MaskedLM` and
:class:`~lightning_gpipe.hf.module.SequenceClassifier` fine-tune one with ``GPipeStrategy`` (every weight, or LoRA
adapters with ``lora=``), each stage building its layers on the meta device and loading only its own weights;
:func:`greedy_generate` decodes through the pipeline, each stage keeping its own blocks' key/value caches
(:func:`seq2seq_greedy_generate` and :func:`seq2seq_beam_search` an encoder-decoder's, its self- and cross-attention
caches). Needs ``transformers`` 5.24 or newer (``peft``
for LoRA). Guide: docs/transformers.md.

Importing it with an older ``transformers`` (or none) raises ``ImportError`` naming the ``pip`` command that fixes it:
5.24 renamed the arguments of the ``masking_utils`` functions the decoders call, so an older one would fail later, in
the self-check, with a message about the model instead.
"""

from lightning_utilities.core.imports import RequirementCache

_TRANSFORMERS = RequirementCache("transformers>=5.24")
if not _TRANSFORMERS:
    raise ImportError(f"lightning_gpipe.hf needs transformers 5.24 or newer: {_TRANSFORMERS.message}")

# ruff: noqa: E402 - the package's modules are imported only once the requirement holds
from lightning_gpipe.hf.adapter import FAMILIES, Family, check_class, family_of, register_family, to_sequential
from lightning_gpipe.hf.kv_cache import CachedDecoderBlock, clear_kv_caches, positions_from_mask
from lightning_gpipe.hf.layer import HFLayer, UnsupportedModelError
from lightning_gpipe.hf.module import (
    CausalLM,
    HFModule,
    MaskedLM,
    SavePretrained,
    Seq2SeqLM,
    SequenceClassifier,
    greedy_generate,
    lr_factor,
)
from lightning_gpipe.hf.moe import RouterLoss
from lightning_gpipe.hf.packing import pack_documents, packed_batch
from lightning_gpipe.hf.selfcheck import SelfCheckError
from lightning_gpipe.hf.seq2seq_generate import seq2seq_beam_search, seq2seq_greedy_generate
from lightning_gpipe.hf.weights import SafetensorsWeights, save_stage_shards

__all__ = [
    "CachedDecoderBlock",
    "CausalLM",
    "FAMILIES",
    "Family",
    "HFLayer",
    "HFModule",
    "MaskedLM",
    "RouterLoss",
    "SafetensorsWeights",
    "SavePretrained",
    "SelfCheckError",
    "Seq2SeqLM",
    "SequenceClassifier",
    "UnsupportedModelError",
    "check_class",
    "clear_kv_caches",
    "family_of",
    "greedy_generate",
    "lr_factor",
    "pack_documents",
    "packed_batch",
    "positions_from_mask",
    "register_family",
    "save_stage_shards",
    "seq2seq_beam_search",
    "seq2seq_greedy_generate",
    "to_sequential",
]
