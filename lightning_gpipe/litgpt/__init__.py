"""litgpt's ``GPT`` in the pipeline (``lightning_gpipe.litgpt``).

:func:`to_sequential` turns a ``GPT`` of any config into the backbone contract without copying weights (the embedding,
one layer per block carrying its rope tables and masks, the final norm and the head), after proving the cut on a
miniature of its config (:func:`check_cut`); :class:`CausalLM` trains one with ``GPipeStrategy``, each stage building
its layers on the meta device and reading only its own tensors of a ``lit_model.pth`` (:class:`LitCheckpoint`);
:func:`greedy_generate` decodes through the pipeline, each stage keeping litgpt's key/value caches of its own blocks.
Needs ``litgpt`` 0.5.13 or newer (its model code only: not ``transformers``).

Importing it without litgpt raises ``ImportError`` naming the ``pip`` command that installs it.
"""

from lightning_utilities.core.imports import RequirementCache

_LITGPT = RequirementCache("litgpt>=0.5.13")
if not _LITGPT:
    raise ImportError(
        f'lightning_gpipe.litgpt needs litgpt 0.5.13 or newer: pip install "lightning-gpipe[litgpt]"'
        f" ({_LITGPT.message})"
    )

# ruff: noqa: E402 - the package's modules are imported only once the requirement holds
from lightning_gpipe.litgpt.adapter import to_sequential
from lightning_gpipe.litgpt.checkpoint import LitCheckpoint
from lightning_gpipe.litgpt.cut import Block, Embedding, FinalNorm, Head, RopeTables
from lightning_gpipe.litgpt.generate import clear_kv_caches, greedy_generate, prepare_kv_caches
from lightning_gpipe.litgpt.layer import LitLayer, lit_name
from lightning_gpipe.litgpt.module import CausalLM
from lightning_gpipe.litgpt.selfcheck import SelfCheckError, check_cut

__all__ = [
    "Block",
    "CausalLM",
    "SelfCheckError",
    "Embedding",
    "FinalNorm",
    "Head",
    "LitCheckpoint",
    "LitLayer",
    "RopeTables",
    "check_cut",
    "clear_kv_caches",
    "greedy_generate",
    "lit_name",
    "prepare_kv_caches",
    "to_sequential",
]
