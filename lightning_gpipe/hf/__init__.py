"""Hugging Face ``transformers`` models in the pipeline (``lightning_gpipe.hf``).

:func:`to_sequential` turns a loaded model into the backbone contract without copying weights;
:class:`~lightning_gpipe.hf.module.CausalLM` and :class:`~lightning_gpipe.hf.module.MaskedLM` fine-tune one with
``GPipeStrategy``, each stage building its layers on the meta device and loading only its own weights;
:func:`greedy_generate` decodes through the pipeline, each stage keeping its own blocks' key/value
caches. Needs ``transformers`` 5 or newer. Guide: docs/transformers.md.
"""

from lightning_gpipe.hf.adapter import (
    FAMILIES,
    CachedDecoderBlock,
    Family,
    HFLayer,
    UnsupportedModelError,
    clear_kv_caches,
    family_of,
    positions_from_mask,
    register_family,
    to_sequential,
)
from lightning_gpipe.hf.module import (
    CausalLM,
    HFModule,
    MaskedLM,
    SavePretrained,
    SequenceClassifier,
    greedy_generate,
    lr_factor,
)
from lightning_gpipe.hf.weights import SafetensorsWeights, save_stage_shards

__all__ = [
    "CachedDecoderBlock",
    "CausalLM",
    "FAMILIES",
    "Family",
    "HFLayer",
    "HFModule",
    "MaskedLM",
    "SafetensorsWeights",
    "SavePretrained",
    "SequenceClassifier",
    "UnsupportedModelError",
    "clear_kv_caches",
    "family_of",
    "greedy_generate",
    "lr_factor",
    "positions_from_mask",
    "register_family",
    "save_stage_shards",
    "to_sequential",
]
