"""Causal LMs whose decoder is one stack module that embeds its tokens itself, recognised by structure: the decoders of
encoder-decoders exposed as causal LMs (BART, mBART, Marian, Blenderbot, Blenderbot-Small, Pegasus, PLBart,
BigBird-Pegasus, TrOCR, Whisper), OPT, BioGPT, GPT-NeoX-Japanese, ModernBERT-decoder, CTRL, OpenAI GPT, Zaya and
RecurrentGemma.

The model's children are its base model (``base_model_prefix``) and its output head (``get_output_embeddings()``:
``lm_head``, BioGPT's ``output_projection``, GPT-NeoX-Japanese's ``embed_out``), and at most one more module with
parameters, applied between them (ModernBERT-decoder's prediction head ``lm_head``); the stack is the base model
(BioGPT) or the base model's one child (the wrapper's ``model.decoder``). The stack holds one ``nn.ModuleList`` of
blocks, modules its forward applies after them (:func:`after_blocks`: its final norm, OPT's ``project_out``, read from
its forward's code), optionally a rotary embedding (``rotary_emb``, which every block's layer calls, and the embedding
layer, whose forward calls it too) and modules applied
before the blocks, in an order its forward alone knows (token and position embeddings, BART's
``layernorm_embedding`` registered after the blocks, OPT's ``project_in``). So the embedding layer
(:class:`StackDecoderEmbedding`) runs the stack's own forward up to its first block (a pre-hook stops it there), as
the encoder-decoders' embeddings do (:class:`~lightning_gpipe.hf.seq2seq.StackEmbedding`): the positions it numbers
(BART's from 0 over the padding too, OPT's and BioGPT's from the mask), the scaling and the norms need no code here.
The blocks are :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` (the causal mask, the cache, the positions and
rotary cos/sin where they take them; a BART decoder block's cross-attention is given no encoder output, as the causal
LM's forward gives it none; the padding mask alone where the stack's forward builds its mask itself, OpenAI GPT's,
:func:`~lightning_gpipe.hf.masks.builds_own_mask`; a hybrid layer type's two masks in one dict where its forward gives
them so, Zaya's, :func:`~lightning_gpipe.hf.decoder_layout.mask_keys`; a value carried from block to block,
``prev_...``, Zaya's router states; a recurrent layer type's block, RecurrentGemma's, its state fresh per sequence in
training and kept per set of rows in cached decoding); the end (:class:`StackHead`) applies what the stack's forward
applies after its blocks, then the head, its logits scaled as the config declares (RecurrentGemma's soft-capping). A
class whose forward scores unshifted labels (BART's family) is trained on its own loss
(:func:`~lightning_gpipe.hf.decoder.shifts_labels`).

:func:`decoder_stack` says why a model is not of the layout: an encoder-decoder config (the encoder-decoder family's),
blocks taking what the adapter does not compute (MVP's prompts with ``use_prompt=True``: off, the blocks' default
``None`` is what the stack gives them; ProphetNet's n-gram streams), layer types it does not know or that take an
attention and a recurrent mask at once (:data:`~lightning_gpipe.hf.masks.HYBRID`) but where its forward gives both in
one dict, cross-attention asked for (``add_cross_attention``), a load-balancing loss (``output_router_logits=True``:
:func:`~lightning_gpipe.hf.gpt2_like.router_loss_reason`), LayerDrop (layers skipped at random), tensors of the
stack's own that it saves where it has no module before its blocks. Tensors of its own (CTRL's unsaved sinusoidal
``pos_encoding``, RecurrentGemma's unsaved ``normalizer``, Zaya's input scale and bias) are held by the embedding
layer, which lends them to the stack before running its forward and initialises them on a stage as the model does
(those a checkpoint gives, read); in decoding a stack whose forward takes ``position_ids`` is given the positions
``generate`` gives (CTRL's, OpenAI GPT's; in cached decoding, Whisper's too). A block taking no cache (OpenAI GPT's)
decodes without caches (cached decoding is refused, naming that). The self-check (:mod:`lightning_gpipe.hf.selfcheck`)
proves the cut on a miniature before step 1. Packed rows are refused (the stack numbers the positions of a whole row).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children, set_buffer
from lightning_gpipe.hf.decoder import GPT2LikeBlock, Head
from lightning_gpipe.hf.decoder_cut import head_scaling
from lightning_gpipe.hf.decoder_layout import (
    CARRIED,
    ROTARY,
    block_loops_reason,
    forward_names,
    layer_types_reason,
    mask_keys,
)
from lightning_gpipe.hf.gpt2_like import ARGUMENTS, hidden_name, router_loss_reason
from lightning_gpipe.hf.kv_cache import is_decoding
from lightning_gpipe.hf.layer import PreTrainedModel
from lightning_gpipe.hf.masks import HYBRID, builds_own_mask, layer_type, padding_mask
from lightning_gpipe.hf.seq2seq import Stack, StackEmbedding
from lightning_gpipe.hf.seq2seq_cache import past_length_cache
from lightning_gpipe.hf.seq2seq_inputs import PROMPTS


def after_blocks(stack: nn.Module, blocks: str) -> list[str]:
    """The children of ``stack`` its forward applies after its blocks (the ``nn.ModuleList`` ``blocks``), in order:
    those it first names after ``blocks`` (the names its code uses, in the order of their first use; decorators
    unwrapped): the final norm (``layer_norm``, ``final_layer_norm``; BigBird-Pegasus's ``layernorm_embedding``),
    OPT's ``project_out``. The stack registers its children in no order its forward follows (OPT registers
    ``final_layer_norm`` before ``layers``, BART ``layernorm_embedding`` after them, applying it before); the
    self-check proves the reading."""
    names = forward_names(stack)  # find_stack: ``blocks`` among them
    own = _named(stack)
    return [name for name in names[names.index(blocks) + 1 :] if name in own]


@dataclass(frozen=True)
class DecoderStack:
    """Where a decoder stack's modules are.

    Attributes:
        stack: the stack module (``"model.decoder"``, BioGPT's ``"biogpt"``).
        blocks: its ``nn.ModuleList`` of blocks (``"model.decoder.layers"``).
        embedding: its children applied before the blocks (by its forward).
        end: its children applied after the blocks, in order (:func:`after_blocks`).
        head: the model's output head (``"lm_head"``).
        rotary: its rotary embedding (``rotary_emb``), which every block's layer calls, or ``None``.
        prediction: a child of the model its forward applies between the stack and the head (ModernBERT-decoder's
            prediction head ``lm_head``: dense, activation, norm, before its output embeddings ``decoder``), or
            ``None``.
    """

    stack: str
    blocks: str
    embedding: tuple[str, ...]
    end: tuple[str, ...]
    head: str
    rotary: str | None = None
    prediction: str | None = None


def _named(module: nn.Module) -> dict[str, nn.Module]:
    return {name: child for name, child in children(module).items() if child is not None}


def find_stack(model: nn.Module) -> DecoderStack | str:
    """The :class:`DecoderStack` of ``model`` (see the module docstring), or why it has none."""
    prefix = getattr(model, "base_model_prefix", "")
    named = _named(model)
    head = next((name for name, child in named.items() if child is cast(Any, model).get_output_embeddings()), None)
    others = [name for name in named if name not in (prefix, head)]
    prediction = others[0] if len(others) == 1 and [*named[others[0]].parameters()] else None
    if head is None or prefix not in named or [name for name in others if name != prediction]:
        return (
            f"its children are {sorted(named)}, not exactly its base model `{prefix}` and its output head (and one"
            " module with parameters before it)"
        )
    stack, path = named[prefix], prefix
    inner = _named(stack)
    if not any(isinstance(child, nn.ModuleList) for child in inner.values()) and len(inner) == 1:
        name, stack = next(iter(inner.items()))  # a wrapper's decoder
        path = f"{prefix}.{name}"
        inner = _named(stack)
    lists = [name for name, child in inner.items() if isinstance(child, nn.ModuleList)]
    if len(lists) != 1 or not len(cast(nn.ModuleList, inner[lists[0]])):
        return f"`{path}` holds {sorted(inner)}, not one nn.ModuleList of blocks"
    if lists[0] not in forward_names(stack):
        return f"`{path}`'s forward does not name its blocks `{lists[0]}`"
    after = after_blocks(stack, lists[0])
    end = tuple(f"{path}.{name}" for name in after)
    embedding = tuple(f"{path}.{name}" for name in inner if name not in (*after, lists[0], ROTARY))
    own = {*dict(stack.named_parameters(recurse=False)), *dict(stack.named_buffers(recurse=False))}
    if not embedding and own & set(stack.state_dict(keep_vars=True)):
        return f"`{path}` holds tensors of its own that it saves and no module before its blocks to hold them with"
    rotary = f"{path}.{ROTARY}" if ROTARY in inner else None
    return DecoderStack(path, f"{path}.{lists[0]}", embedding, end, head, rotary, prediction)


def decoder_stack(model: nn.Module) -> str | None:
    """``None`` when ``model`` is a causal LM of one decoder stack (see the module docstring), else why not: not an
    encoder-decoder config, a stack (:func:`find_stack`) whose forward takes ``input_ids`` and ``attention_mask`` and
    whose blocks take only :data:`~lightning_gpipe.hf.gpt2_like.ARGUMENTS` (and MVP's prompts, off), layer types
    whose masks the adapter rebuilds and none hybrid, no cross-attention asked for, no load-balancing loss, no
    LayerDrop, the blocks run in one loop (:func:`~lightning_gpipe.hf.decoder_layout.block_loops_reason`)."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "its config is an encoder-decoder's (is_encoder_decoder=True)"
    found = find_stack(model)
    if isinstance(found, str):
        return found
    stack = model.get_submodule(found.stack)
    if not {"input_ids", "attention_mask"} <= set(inspect.signature(stack.forward).parameters):
        return f"`{found.stack}`'s forward does not take input_ids and attention_mask"
    block = cast(nn.ModuleList, model.get_submodule(found.blocks))[0]
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = inspect.signature(block.forward).parameters.values()
    extra = [p.name for p in parameters if p.kind in named and p.name not in ARGUMENTS | {hidden_name(block)}]
    carried = [name for name in extra if name.startswith(CARRIED)]  # Zaya's router states, block to block
    extra = [name for name in extra if len(carried) != 1 or name != carried[0]]
    if extra and not (set(extra) <= PROMPTS and not getattr(stack, "use_prompt", True)):  # MVP's, off: left None
        return f"its blocks ({type(block).__name__}) take {extra}, which the adapter does not compute"
    unknown = layer_types_reason(config)
    if unknown is not None:
        return unknown
    hybrid = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)} & set(HYBRID))
    if hybrid and mask_keys(type(stack)) is None:
        return (
            f"its layer types include {hybrid}, which take an attention and a recurrent mask at once (the GPT-2-like"
            " layout's hybrid blocks, given the second under a mask argument of their own; this layout takes them"
            " where its forward gives both masks in one dict)"
        )
    if getattr(config, "add_cross_attention", False):
        return "add_cross_attention=True: its blocks attend to an encoder's output, which a causal LM lacks"
    router = router_loss_reason(model)
    if router is not None:
        return router
    loops = block_loops_reason(stack, found.blocks.rpartition(".")[2])
    if loops is not None:
        return loops
    layerdrop = stack.__dict__.get("layerdrop")
    if layerdrop:
        return f"its decoder's layerdrop={layerdrop}: its forward skips layers at random in training"
    return None


class StackDecoderEmbedding(StackEmbedding):
    """A decoder stack's embeddings: ``(input_ids, attention_mask, position_ids[, rows])``, each ``(N, S)`` long (rows
    ``(n,)``), to ``(hidden (N, S, H), attention_mask, position_ids[, rows])``: the stack's own forward up to its first
    block (:class:`~lightning_gpipe.hf.seq2seq.StackEmbedding`), given the ids and the mask (not the positions: the
    stack numbers them as its forward does, but in decoding, :meth:`_positions`). In cached decoding
    (``attention_mask`` ``(n, past + S)``) it is given a cache of ``past`` positions, so the new tokens are numbered
    after the cached ones. It holds the stack's own tensors (lent to the stack) and its rotary embedding, which the
    forward calls before the first block.

    Args:
        model: the model.
        found: the model's :class:`DecoderStack`.

    Raises:
        ValueError: (forward) for packed rows (``documents`` in the value), whose documents the stack would number
            as one sequence.
    """

    def __init__(self, model: PreTrainedModel, found: DecoderStack) -> None:
        rotary = () if found.rotary is None else (found.rotary,)  # its forward calls it before the first block too
        super().__init__(model, Stack(found.stack, found.blocks, found.embedding, found.end, None, True), rotary)
        stack = model.get_submodule(found.stack)
        holder = self.get_submodule(found.stack) if found.embedding else self  # under the stack's own path
        saved = set(stack.state_dict(keep_vars=True))
        for name, parameter in stack.named_parameters(recurse=False):  # Zaya's input scale and bias
            holder.register_parameter(name, parameter)
        for name, buffer in stack.named_buffers(recurse=False):  # CTRL's sinusoidal table, unsaved
            holder.register_buffer(name, buffer, persistent=name in saved)
        self._lent_parameters = [name for name, _ in stack.named_parameters(recurse=False)]
        self._lent = [*self._lent_parameters, *(name for name, _ in stack.named_buffers(recurse=False))]
        self._holder = found.stack if found.embedding else ""
        self._takes_positions = "position_ids" in inspect.signature(stack.forward).parameters
        self._given_positions = "position_ids" in inspect.signature(model.forward).parameters  # generate gives them

    def _lend(self) -> nn.Module:
        """The stack, given the parameters and buffers of its own this layer holds (its forward reads them; a stage
        materialises them here, not in the model's stack, which it does not build)."""
        stack = self.hf_model.get_submodule(self.stack.path)
        holder = self.get_submodule(self._holder)
        for name in self._lent:
            if name in self._lent_parameters:
                setattr(stack, name, holder.get_parameter(name))
            else:
                set_buffer(stack, name, holder.get_buffer(name))
        return stack

    def reset_parameters(self) -> None:
        """:meth:`~lightning_gpipe.hf.layer.HFLayer.reset_parameters`, then the stack's own tensors this layer holds
        that :attr:`weights` does not give initialised as the model initialises them (its ``_init_weights`` of the
        stack: CTRL's sinusoidal table, Zaya's input scale and bias)."""
        super().reset_parameters()
        if not self._lent:
            return
        holder = self.get_submodule(self._holder)
        loaded = {id(t) for t in self._provided().values()}
        own = [*holder.parameters(recurse=False), *holder.buffers(recurse=False)]
        kept = [(tensor, tensor.detach().clone()) for tensor in own if id(tensor) in loaded]
        with torch.no_grad():
            self.hf_model._init_weights(self._lend())
            for tensor, value in kept:  # the checkpoint's, as read
                tensor.copy_(value)

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        self._lend()
        input_ids, attention_mask, position_ids, *rest = value
        if any(item.dim() == 2 for item in rest):
            raise ValueError(
                f"{type(self.hf_model).__name__}'s decoder numbers the positions of a whole row itself: give it"
                " unpacked batches (no position_ids)."
            )
        inputs: dict[str, Any] = {"use_cache": False} if self._use_cache else {}
        past = attention_mask.shape[1] - input_ids.shape[1]
        if past:
            inputs["cache"] = past_length_cache(past, attention_mask).self_attention_cache
        inputs.update(self._positions(position_ids, rest))
        return (self._embedded(input_ids, attention_mask, inputs), attention_mask, position_ids, *rest)

    def _positions(self, position_ids: Tensor, rest: list[Tensor]) -> dict[str, Tensor]:
        """The positions given to the stack's forward (``rest``: the value's items after them), where it takes them:
        the value's, as ``generate`` gives them, in cached decoding (``rows`` in ``rest``) and in any decoding step
        (:func:`~lightning_gpipe.hf.kv_cache.is_decoding`) of a model whose forward takes them (``generate`` gives
        them then: CTRL's, OpenAI GPT's); else none, the stack numbers them itself."""
        given = self._given_positions and is_decoding((position_ids, *rest))
        return {"position_ids": position_ids} if self._takes_positions and (rest or given) else {}


class StackHead(Head):
    """A decoder stack's end and the head: ``(hidden, ...)`` to logits ``(N, S, V)``, through the modules the
    stack's forward applies after its blocks (:attr:`DecoderStack.end`), then the model's prediction head if it has one
    (:attr:`DecoderStack.prediction`) and its output head, the logits scaled as its config declares
    (:func:`~lightning_gpipe.hf.decoder_cut.head_scaling`: RecurrentGemma's soft-capping, ``logits_soft_cap``).

    Args:
        model: the model.
        found: the model's :class:`DecoderStack`.
    """

    def __init__(self, model: PreTrainedModel, found: DecoderStack) -> None:
        before = (*found.end, *([found.prediction] if found.prediction else []))
        super().__init__(model, found.head, before=before, **head_scaling(model.config)[1])

    def forward(self, value: tuple[Tensor, ...]) -> Tensor:  # type: ignore[override]  # the blocks' value
        return cast(Tensor, super().forward(value[0]))


def decoder_stack_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a causal LM of one decoder stack (:func:`decoder_stack`): the stack's embeddings, one
    :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` per block (given the padding mask alone,
    :func:`~lightning_gpipe.hf.masks.padding_mask`, where the stack's forward builds its mask itself:
    :func:`~lightning_gpipe.hf.masks.builds_own_mask`), the stack's end with the head."""
    found = find_stack(model)
    assert not isinstance(found, str)  # the family takes only models of the layout
    count = len(cast(nn.ModuleList, model.get_submodule(found.blocks)))
    mask = padding_mask if builds_own_mask(model.get_submodule(found.stack)) else None  # OpenAI GPT's
    return [
        StackDecoderEmbedding(model, found),
        *(GPT2LikeBlock(model, f"{found.blocks}.{i}", found.rotary, mask) for i in range(count)),
        StackHead(model, found),
    ]
