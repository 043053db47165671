"""The causal-LM heads of BERT-style encoders, run as decoders with ``is_decoder=True`` (BERT's ``BertLMHeadModel``,
RoBERTa, XLM-RoBERTa(-XL), CamemBERT, Data2Vec-Text, ERNIE, RoC-BERT, ELECTRA, Megatron-BERT, RemBERT,
RoBERTa-PreLayerNorm, RoFormer, X-MOD, BigBird, BertGeneration's decoder), recognised by structure.

``transformers`` builds these classes from an encoder's config and asks for ``is_decoder=True`` to use them as
standalone causal LMs: the model's forward then builds the causal mask (``create_causal_mask``) where the encoder
builds a bidirectional one. Without it they are bidirectional encoders, which :mod:`lightning_gpipe.hf.encoder` cuts,
no causal LM.

Their base model (``base_model_prefix``) holds ``embeddings``, an ``encoder`` whose one ``nn.ModuleList`` holds the
blocks, and modules either forward applies before the blocks (ELECTRA's ``embeddings_project``, RemBERT's
``embedding_hidden_mapping_in``) or after them, named after the blocks in their forward's code
(:func:`~lightning_gpipe.hf.decoder_stack.after_blocks`: XLM-RoBERTa-XL's and Megatron-BERT's final norm in the
encoder, RoBERTa-PreLayerNorm's in the base model); the model's other children are its head: the one holding the
output embedding (``cls``, ``lm_head``, ELECTRA's ``generator_lm_head``), after at most one other (ELECTRA's
``generator_predictions``). So the cut is a :class:`~lightning_gpipe.hf.decoder_stack.DecoderStack` whose stack is the
base model: the embedding layer runs the base model's own forward up to its first block
(:class:`CausalEncoderEmbedding`: word, position and token-type embeddings as its embeddings module computes them,
RoBERTa's positions counted past the padding id; in decoding the positions ``generate`` gives), each block is a
:class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` with the causal mask of the ``(N, S)`` padding mask rebuilt as the
model's forward builds it (:class:`CausalEncoderBlock`: with what the forward computes once for all blocks where they
take it, RoFormer's rotary ``sinusoidal_pos``, X-MOD's ``lang_ids``), and the end
(:class:`~lightning_gpipe.hf.decoder_stack.StackHead`) applies the final norms and the head. Their forward scores
shifted labels (``self.loss_function``), as :class:`~lightning_gpipe.hf.CausalLM` does. The self-check
(:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on a miniature before step 1.

:func:`causal_encoder` says why a model is not of the layout: ``is_decoder=False`` (a bidirectional encoder),
``add_cross_attention=True`` (the decoder of an encoder-decoder, whose blocks read an encoder's output), BigBird's
``attention_type="block_sparse"`` (bidirectional), blocks taking what their forward computes for them and the adapter
does not, tensors of the base model or its encoder's own. Packed rows are refused (the base model numbers the
positions of a whole row).
"""

from __future__ import annotations

import inspect
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.engine import attach
from lightning_gpipe.hf.decoder import GPT2LikeBlock
from lightning_gpipe.hf.decoder_stack import DecoderStack, StackDecoderEmbedding, StackHead, after_blocks
from lightning_gpipe.hf.gpt2_like import ARGUMENTS
from lightning_gpipe.hf.layer import PreTrainedModel

EMBEDDINGS, ENCODER, BLOCKS, POOLER, POSITIONS = "embeddings", "encoder", "layer", "pooler", "embed_positions"
"""The base model's embeddings and encoder, the encoder's ``nn.ModuleList`` of blocks, the base model's pooler and the
encoder's rotary position module (RoFormer's), as BERT and its kin name them."""

FULL_ATTENTION = "original_full"
"""BigBird's ``attention_type`` of full attention, with which its forward gives its blocks none of the block-sparse
masks (:data:`SPARSE_MASKS`) and builds the causal mask; with ``"block_sparse"`` its attention is bidirectional, and
its forward switches the model to full attention itself on short sequences."""

COMPUTED = frozenset(("sinusoidal_pos", "lang_ids"))
"""Block arguments the encoder's or base model's forward computes once for all blocks and each block layer computes
as it does (:class:`CausalEncoderBlock`): RoFormer's rotary ``sinusoidal_pos``, X-MOD's ``lang_ids``."""

SPARSE_MASKS = frozenset(("band_mask", "from_mask", "to_mask", "blocked_encoder_mask"))
"""BigBird's block-sparse masks, which its blocks take and its forward gives as ``None`` with full attention
(:data:`FULL_ATTENTION`)."""


def _named(module: nn.Module) -> dict[str, nn.Module]:
    return {name: child for name, child in children(module).items() if child is not None}


def find_causal_encoder(model: nn.Module) -> DecoderStack | str:
    """The :class:`~lightning_gpipe.hf.decoder_stack.DecoderStack` of a model of the layout (see the module
    docstring), or why it has none: the base model as the stack; ``embedding`` its modules and its encoder's but the
    blocks and the ends (with a pooler, BigBird's, whose output the head does not read: held, never called);
    ``end`` the final norms the encoder's forward then the base model's names after the blocks (before a pooler),
    then the head's first module where it has two."""
    prefix = getattr(model, "base_model_prefix", "")
    named = _named(model)
    base = named.get(prefix)
    output = cast(Any, model).get_output_embeddings()
    head = [name for name, child in named.items() if name != prefix and any(m is output for m in child.modules())]
    others = [name for name in named if name not in (prefix, *head)]
    if base is None or len(head) != 1 or len(others) > 1:
        return f"its children are {sorted(named)}, not its base model `{prefix}` and a head (of at most two modules)"
    inner = _named(base)
    encoder = inner.get(ENCODER)
    blocks = None if encoder is None else _named(encoder).get(BLOCKS)
    if not isinstance(blocks, nn.ModuleList) or not len(blocks) or EMBEDDINGS not in inner:
        return f"`{prefix}` holds {sorted(inner)}, not embeddings and an encoder holding the nn.ModuleList `{BLOCKS}`"
    encoder = cast(nn.Module, encoder)
    own = [*base.parameters(recurse=False), *base.buffers(recurse=False), *encoder.parameters(recurse=False)]
    if own:
        return f"`{prefix}` or its encoder holds tensors of its own, which no layer can hold"
    ends = [f"{prefix}.{ENCODER}.{name}" for name in after_blocks(encoder, BLOCKS)]
    after = [name for name in after_blocks(base, ENCODER) if name != EMBEDDINGS]  # X-MOD's names its encoder first
    ends += [f"{prefix}.{name}" for name in after[: after.index(POOLER) if POOLER in after else None]]
    before = [f"{prefix}.{name}" for name in inner if name != ENCODER]
    before += [f"{prefix}.{ENCODER}.{name}" for name in _named(encoder) if name != BLOCKS]
    embedding = tuple(path for path in before if path not in ends)
    blocks_path = f"{prefix}.{ENCODER}.{BLOCKS}"
    return DecoderStack(prefix, blocks_path, embedding, (*ends, *others), head[0])


def causal_encoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is a BERT-style causal-LM head with ``is_decoder=True`` (see the module docstring),
    else why not: a config with ``is_decoder=True``, no cross-attention and no encoder-decoder; the layout
    (:func:`find_causal_encoder`); blocks taking only :data:`~lightning_gpipe.hf.gpt2_like.ARGUMENTS`."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "its config is an encoder-decoder's (is_encoder_decoder=True)"
    if not getattr(config, "is_decoder", False):
        return "is_decoder=False: a bidirectional encoder (set is_decoder=True to run it as a causal LM)"
    if getattr(config, "add_cross_attention", False):
        return (
            "add_cross_attention=True: its blocks attend to an encoder's output (the decoder of an encoder-decoder),"
            " which a causal LM lacks"
        )
    attention = getattr(config, "attention_type", None)
    if attention not in (None, FULL_ATTENTION):
        return (
            f"attention_type={attention!r}: block-sparse attention, bidirectional (transformers runs a BigBird decoder"
            f" with attention_type={FULL_ATTENTION!r}: set it)"
        )
    found = find_causal_encoder(model)
    if isinstance(found, str):
        return found
    block = cast(nn.ModuleList, model.get_submodule(found.blocks))[0]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(block.forward).parameters.values()
    given = ARGUMENTS | COMPUTED | (SPARSE_MASKS if attention == FULL_ATTENTION else frozenset())
    extra = [p.name for p in parameters if p.kind in named and p.name not in given]
    if extra:
        return f"its blocks ({type(block).__name__}) take {extra}, which its forward computes and the adapter does not"
    return None


class CausalEncoderEmbedding(StackDecoderEmbedding):
    """The embeddings of a BERT-style causal LM: a :class:`~lightning_gpipe.hf.decoder_stack.StackDecoderEmbedding`
    (the base model's forward up to its first block) that, in a decoding step
    (:func:`~lightning_gpipe.hf.kv_cache.is_decoding`), gives the forward the value's ``position_ids`` ``(N, S)``
    where the model's forward takes them, as ``generate`` does: each row's real tokens counted from 0 in the attention
    mask (:func:`~lightning_gpipe.hf.kv_cache.positions_from_mask`), the padding 0. In training and evaluation it gives
    none, as the model's forward is called: BERT's embeddings then number a row's tokens from its start (the left
    padding too), RoBERTa's from its padding id up, skipping the tokens equal to it; so a left-padded prompt (and
    RoBERTa's any prompt) is numbered otherwise in ``generate`` than in the forward, and each path here equals its
    own. RoFormer's forward takes no positions (its rotary positions count from the row's start in both).

    Args:
        model: the model.
        found: the model's :class:`~lightning_gpipe.hf.decoder_stack.DecoderStack`.
    """

    def __init__(self, model: PreTrainedModel, found: DecoderStack) -> None:
        super().__init__(model, found)
        self._takes_positions = "position_ids" in inspect.signature(model.forward).parameters  # as generate asks


class CausalEncoderBlock(GPT2LikeBlock):
    """One block of a BERT-style causal LM: a :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` (the causal mask of
    the ``(N, S)`` padding mask, the cache in cached decoding) that also gives the block what the forward computes
    once for all blocks where it takes it (:data:`COMPUTED`): RoFormer's ``sinusoidal_pos`` ``(1, 1, S, D)``, its
    encoder's ``embed_positions`` of the ``S`` new positions after the cached ones; X-MOD's ``lang_ids`` ``(N,)``,
    the index of ``config.default_language`` among ``config.languages`` for every row (the language its forward
    takes when given none).

    Args:
        model: the model.
        block: path of the block (``"roformer.encoder.layer.2"``).
        positions: path of the module giving ``sinusoidal_pos`` (``"roformer.encoder.embed_positions"``), held by
            every block layer, or ``None`` (default) for a block that takes none.

    Raises:
        ValueError: (forward) for a block taking ``lang_ids`` of a config without ``default_language``, as the
            model's forward raises.
    """

    def __init__(self, model: PreTrainedModel, block: str, positions: str | None = None) -> None:
        super().__init__(model, block)
        self._positions = positions
        if positions is not None:  # held besides the block, as a rotary module is
            attach(self, positions, model.get_submodule(positions))
            self.paths = (*self.paths, positions)

    def _extra(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor, mask: Any) -> dict[str, Any]:
        arguments = super()._extra(hidden, attention_mask, position_ids, mask)
        if self._positions is not None:
            past = attention_mask.shape[1] - hidden.shape[1]
            arguments["sinusoidal_pos"] = self.part(self._positions)(hidden.shape[:-1], past)[None, None, :, :]
        if "lang_ids" in self._arguments:
            language = self.config.default_language
            if language is None:
                raise ValueError(f"{type(self.hf_model).__name__}: input language unknown: set its default_language.")
            index = list(self.config.languages).index(language)
            arguments["lang_ids"] = torch.full((hidden.shape[0],), float(index), device=hidden.device)
        return arguments


def causal_encoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a BERT-style causal-LM head (:func:`causal_encoder`): the base model's forward up to its
    first block (:class:`CausalEncoderEmbedding`), one :class:`CausalEncoderBlock` per block, the final norms with the
    head."""
    found = find_causal_encoder(model)
    assert not isinstance(found, str)  # the family takes only models of the layout
    blocks = cast(nn.ModuleList, model.get_submodule(found.blocks))
    rotary = "sinusoidal_pos" in inspect.signature(blocks[0].forward).parameters
    positions = f"{found.stack}.{ENCODER}.{POSITIONS}" if rotary else None
    return [
        CausalEncoderEmbedding(model, found),
        *(CausalEncoderBlock(model, f"{found.blocks}.{i}", positions) for i in range(len(blocks))),
        StackHead(model, found),
    ]
