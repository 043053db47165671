"""Encoder-decoders (``AutoModelForSeq2SeqLM``: T5, mT5, umT5, BART, mBART, Marian, M2M100/NLLB, Pegasus...) as backbone
layers, found by structure.

The model holds an encoder stack and a decoder stack (``get_encoder()``, ``get_decoder()``), each its embeddings, one
``nn.ModuleList`` of blocks and optionally a final norm (``final_layer_norm`` or ``layer_norm``), then ``lm_head`` (and
BART's ``final_logits_bias``). :func:`encoder_decoder` recognises that layout, or says why a model is not of it;
:func:`encoder_decoder_layers` cuts it into: the encoder's embeddings (:class:`StackEmbedding`), one :class:`StackBlock`
per encoder block, the encoder's final norm (:class:`StackNorm`), the decoder's embeddings, one layer per decoder block,
the decoder's final norm, and the head (:class:`Seq2SeqHead`).

Between layers travels ``(source, source_mask (N, S), target, target_mask (N, T))``, as in the translation example:
``source`` is the source ids ``(N, S)``, then the encoder's hidden states ``(N, S, H)`` (the decoder's cross-attention
input, carried to every decoder stage); ``target`` is the decoder's input ids ``(N, T)``, then its hidden states ``(N,
T, H)``. Each block rebuilds its 4-D masks from the ``(N, S)`` and ``(N, T)`` masks (bidirectional for the encoder,
causal and cross for the decoder, ``transformers.masking_utils`` with the stack's config), and a T5 block its relative
position bias: the stack's first block computes it with the bias table it holds, and every later block's layer holds
that table too (one parameter on several stages, which the tie mechanism keeps one) and computes it with the same method
(``compute_bias``). An embedding layer runs its stack's own forward up to the first block (what it adds to the
embeddings: scaling, learned or sinusoidal positions, a norm, dropout), so its family's variations need no code here.

Cached decoding (:func:`~lightning_gpipe.hf.seq2seq_generate.seq2seq_greedy_generate`,
:func:`~lightning_gpipe.hf.seq2seq_generate.seq2seq_beam_search`) adds ``rows`` ``(n,)`` long at the end of the value
(which rows of the batch these are): each decoder block then keeps its own self- and cross-attention caches for them
(:class:`~lightning_gpipe.hf.seq2seq_cache.DecoderCaches`). The first step is the whole value as above (the encoder
runs, once); at every later step ``source`` is a ``(n,)`` stand-in (:func:`later_step`: the encoder's layers pass the
value on, the cross-attention reads its cached keys and values), ``target`` the new tokens' ids ``(n, 1)`` and
``target_mask`` ``(n, past + 1)`` covers every decoder token so far, so between decoder stages travel only the new
tokens' hidden states. The decoder's embeddings number the new positions from ``past`` (the stack's forward is given a
cache of that length, :func:`~lightning_gpipe.hf.seq2seq_cache.past_length_cache`), as under ``generate``.
LayerDrop (Fan et al. 2019, arXiv:1909.11556: M2M100's and Seamless's default ``layerdrop``) is drawn by each block's
layer as the stack's forward draws it. Blocks that take more than a mask (MVP's prompts, LongT5's local attention, LED's
Longformer attention, Pegasus-X's global tokens, BigBird-Pegasus's full attention where its encoder falls back to it,
T5Gemma's rotary positions and sliding windows) get what their stack's forward gives them
(:mod:`lightning_gpipe.hf.seq2seq_inputs`). A stack's final norm is the module its forward calls after its blocks
(:data:`NORMS` by name, or by the forward's source: BigBird-Pegasus's ``layernorm_embedding``, T5Gemma's ``norm``). What
stays refused, before step 1: blocks taking arguments the layers do not compute (FSMT's, ProphetNet's, MVP's prompts
with ``use_prompt=True``), a mixture of experts' load-balancing loss (``output_router_logits``), modules besides the
stacks, the shared embedding and the head; the self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on a
miniature before step 1. Models: T5 (Raffel et al. 2020, arXiv:1910.10683), BART (Lewis et al. 2020, arXiv:1910.13461),
M2M100 and NLLB (arXiv:2010.11125, 2207.04672), as ``transformers`` 5.24 implements them.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.decoder_layout import ROTARY
from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel
from lightning_gpipe.hf.masks import layer_type
from lightning_gpipe.hf.seq2seq_cache import DecoderCaches, past_length_cache
from lightning_gpipe.hf.seq2seq_inputs import (
    DECODER_MASKS,
    ENCODER_MASKS,
    PROMPTS,
    attention_kind,
    derived_mask,
    encoder_inputs,
    encoder_output,
    full_attention,
    local_bias,
)

try:
    from transformers.masking_utils import create_bidirectional_mask
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

SEQ2SEQ_INPUTS = "(input_ids, attention_mask, decoder_input_ids, decoder_attention_mask)"
"""What an encoder-decoder's backbone takes (see :func:`seq2seq_input`)."""

BLOCK_ARGUMENTS = frozenset(
    ("hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "cache", "use_cache")
    + ("output_attentions", "return_dict", "position_bias", "encoder_decoder_position_bias")
)
"""The named arguments an encoder or decoder block may take: the hidden states, the 4-D self-attention mask, the
encoder's output and the 4-D cross-attention mask (decoder blocks), the cache (a decoder block's own in cached decoding,
else ``None``), T5's relative position biases, and flags left at their defaults."""

NORMS = ("final_layer_norm", "layer_norm")
"""The names of a stack's final norm (T5's ``final_layer_norm``; mBART's, M2M100's, Pegasus's ``layer_norm``)."""

OUTPUT_BIAS = "final_logits_bias"
"""A buffer of the model added to the logits (BART, mBART, Marian, Pegasus)."""


@dataclass(frozen=True)
class Stack:
    """Where an encoder or decoder stack's modules are.

    Attributes:
        path: the stack (``"model.encoder"``).
        blocks: its ``nn.ModuleList`` of blocks (``"model.encoder.layers"``).
        embedding: its modules applied before the blocks (token and position embeddings, a norm on them, a dropout
            module).
        norm: its modules applied after the blocks, in order (the final norm and T5's dropout), or none.
        bias: the module whose ``compute_bias`` gives later blocks their relative position bias (T5's first
            block's self-attention), or ``None``.
        decoder: whether it is the decoder (causal self-attention and cross-attention).
        attention: the kind of its attention (:func:`~lightning_gpipe.hf.seq2seq_inputs.attention_kind`: ``"full"``,
            ``"prompts"``, ``"local"``, ``"longformer"``, ``"global tokens"``, ``"block sparse"``, ``"rotary"``).
    """

    path: str
    blocks: str
    embedding: tuple[str, ...]
    norm: tuple[str, ...]
    bias: str | None
    decoder: bool
    attention: str = "full"


def _path(model: nn.Module, module: nn.Module) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None)


def _called_after(forward: Any, blocks: str) -> set[str]:
    """The names ``name`` of the ``self.name(...)`` calls that ``forward``'s source makes after its loop over
    ``self.<blocks>`` (BigBird-Pegasus's ``layernorm_embedding``, T5Gemma's ``norm``: final norms of other names than
    :data:`NORMS`; BART's ``layernorm_embedding`` is called before its blocks); none without such a loop."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and blocks in map(_self_name, ast.walk(n.iter))]
    if not loops:
        return set()
    end = cast(int, loops[0].end_lineno)
    calls = [_self_name(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno > end]
    return {name for name in calls if name is not None}


def _self_name(node: ast.AST) -> str | None:
    """``name`` where ``node`` is the attribute ``self.name``, else ``None``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _stack(model: nn.Module, module: nn.Module, decoder: bool) -> Stack | str:
    """The :class:`Stack` of ``module`` (a stack of ``model``), or why it is not one the layers take."""
    path, kind = _path(model, module), "decoder" if decoder else "encoder"
    named = {name: child for name, child in children(module).items() if child is not None}
    lists = [name for name, child in named.items() if isinstance(child, nn.ModuleList)]
    if path is None or len(lists) != 1 or not len(cast(nn.ModuleList, named[lists[0]])):
        return f"its {kind} holds {sorted(named)}, not one nn.ModuleList of blocks"
    blocks = cast(nn.ModuleList, named[lists[0]])
    parameters = inspect.signature(blocks[0].forward).parameters.values()
    accepted = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    extra = [p.name for p in parameters if p.kind in accepted and p.name not in BLOCK_ARGUMENTS]
    attention, reason = attention_kind(module, extra, decoder)
    if reason is not None:
        return reason.replace("blocks", f"blocks ({type(blocks[0]).__name__})", 1)
    tensors = {name: [*child.parameters(), *child.buffers()] for name, child in named.items()}
    after = _called_after(type(module).forward, lists[0])
    norm = [name for name in named if (name in NORMS or name in after) and tensors[name]]
    idle = [name for name, child in named.items() if isinstance(child, nn.Dropout)]
    if len(norm) > 1 or list(module.parameters(recurse=False)):
        return f"its {kind} holds {sorted(named)}: more than one final norm, or tensors of its own"
    embedding = tuple(f"{path}.{n}" for n in named if n not in (*lists, *norm) and (tensors[n] or n in idle))
    bias = next((n for n, m in blocks[0].named_modules() if getattr(m, "has_relative_attention_bias", False)), None)
    return Stack(
        path,
        f"{path}.{lists[0]}",
        embedding,
        tuple(f"{path}.{n}" for n in named if n in norm or (norm and n in idle)),
        None if bias is None else f"{path}.{lists[0]}.0.{bias}",
        decoder,
        attention,
    )


def stacks(model: nn.Module) -> tuple[Stack, Stack] | str:
    """``(encoder, decoder)`` :class:`Stack` of ``model``, or why it has none the layers take."""
    get = [getattr(model, name, None) for name in ("get_encoder", "get_decoder")]
    if not all(callable(g) for g in get):
        return "it has no get_encoder() and get_decoder()"
    found = [_stack(model, g(), decoder) for g, decoder in zip(get, (False, True))]  # type: ignore[misc]
    reasons = [s for s in found if isinstance(s, str)]
    if reasons:
        return reasons[0]
    return cast(Stack, found[0]), cast(Stack, found[1])


def encoder_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the encoder-decoder layout (see the module docstring), else why not: an
    encoder-decoder config (``is_encoder_decoder``) without a load-balancing loss, an encoder and a decoder stack
    (:func:`stacks`), an ``lm_head``, and no tensors besides theirs, the shared input embedding and
    ``final_logits_bias``."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    config = model.config
    if not getattr(config, "is_encoder_decoder", False):
        return "its config is not an encoder-decoder's (is_encoder_decoder=False)"
    if getattr(config, "output_router_logits", False):
        return "output_router_logits=True: the layers do not carry a mixture of experts' load-balancing loss"
    found = stacks(model)
    if isinstance(found, str):
        return found
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Module) or (_path(model, head) or "").split(".")[0] != "lm_head":
        return "it has no output head `lm_head` (or within it: T5Gemma's `lm_head.out_proj`)"
    modules = [model.get_submodule(path) for path in (found[0].path, found[1].path, "lm_head")]
    held = {id(t) for m in [*modules, model.get_input_embeddings()] for t in [*m.parameters(), *m.buffers()]}
    held |= {id(getattr(model, OUTPUT_BIAS))} if isinstance(getattr(model, OUTPUT_BIAS, None), Tensor) else set()
    others = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in held]
    if others:
        return f"it holds {others[:3]} besides its encoder, decoder, shared embedding, lm_head and {OUTPUT_BIAS}"
    return None


def seq2seq_input(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    decoder_input_ids: Tensor | None = None,
    decoder_attention_mask: Tensor | None = None,
    labels: Tensor | None = None,
    training: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An encoder-decoder backbone's input: ``(input_ids (N, S), attention_mask (N, S), decoder_input_ids (N, T),
    decoder_attention_mask (N, T))``, long. Without ``decoder_input_ids`` they are ``labels`` shifted right, as the
    model's forward makes them (its ``prepare_decoder_input_ids_from_labels``, else its modeling module's
    ``shift_tokens_right`` with the config's ``pad_token_id`` and ``decoder_start_token_id``: M2M100's); masks default
    to those the stacks' forward uses without one (all ones, or T5Gemma's from the padding tokens, its decoder's in
    ``training`` only: :func:`~lightning_gpipe.hf.seq2seq_inputs.derived_mask`).

    Raises:
        ValueError: with neither ``decoder_input_ids`` nor ``labels``; for padding in ``input_ids`` without
            ``attention_mask`` where the encoder derives a mask from it (T5Gemma's, whose cross-attention then attends
            to every position).
    """
    if decoder_input_ids is None:
        if labels is None:
            raise ValueError("An encoder-decoder batch needs `decoder_input_ids` or `labels` to shift right.")
        prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
        if prepare is not None:
            decoder_input_ids = prepare(labels=labels)
        else:
            shift = sys.modules[type(model).__module__].shift_tokens_right
            decoder_input_ids = shift(labels, model.config.pad_token_id, model.config.decoder_start_token_id)
    decoder_input_ids = cast(Tensor, decoder_input_ids)
    get = cast(Any, model)
    source = derived_mask(get.get_encoder(), input_ids, training) if attention_mask is None else attention_mask
    if not bool(source.all()) and attention_mask is None:
        raise ValueError(
            f"{type(model).__name__}'s encoder masks the padding tokens of a batch without `attention_mask`, and its"
            " cross-attention does not: give the batch's `attention_mask`."
        )
    target = decoder_attention_mask
    target = derived_mask(get.get_decoder(), decoder_input_ids, training) if target is None else target
    return input_ids, source, decoder_input_ids, target


def seq2seq_loss(
    logits: Tensor, labels: Tensor, label_smoothing: float = 0.0, num_targets: int | None = None
) -> Tensor:
    """The model's loss with ``labels`` ``(N, T)`` (``-100`` where none is wanted): cross-entropy of ``logits`` ``(N,
    T, V)`` (each position predicts its label: the decoder's input is shifted), mean over the labelled tokens, with
    ``label_smoothing`` (``torch.nn.functional.cross_entropy``'s; 0 is the model's own loss); with ``num_targets``
    the sum over ``num_targets`` (the targets of a whole batch of which these are some rows)."""
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1).to(logits.device),
        ignore_index=-100,
        label_smoothing=label_smoothing,
        reduction="mean" if num_targets is None else "sum",
    )
    return loss if num_targets is None else loss / num_targets


def later_step(value: tuple[Tensor, ...]) -> bool:
    """Whether ``value`` is a step of cached decoding after the first (see the module docstring): it ends with
    ``rows`` and its ``source`` is a ``(n,)`` stand-in, the encoder's output being in the decoder blocks' caches."""
    return len(value) == 5 and value[0].dim() == 1


class _Reached(Exception):
    """Raised by a pre-hook on a stack's first block: the hidden states its stack's forward gives it, and Pegasus-X's
    global tokens' (its second argument) or ``None``."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("the stack's first block")
        self.hidden = args[0] if args else kwargs["hidden_states"]
        self.global_hidden = args[1] if len(args) > 1 else kwargs.get("global_hidden_states")


def _stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
    raise _Reached(args, kwargs)


class StackEmbedding(HFLayer):
    """A stack's embeddings: the encoder's ``(input_ids, mask, target, target_mask)`` to ``(hidden (N, S, H), mask,
    target, target_mask)``, or the decoder's ``(memory, mask, decoder_input_ids, target_mask)`` to ``(memory, mask,
    hidden (N, T, H), target_mask)``: the stack's own forward up to its first block (a pre-hook stops it there, so the
    blocks, held by other layers, never run here; its ``layerdrop`` is off meanwhile: the blocks' layers draw it). In
    cached decoding (``rows`` at the value's end, passed on) the encoder's embeddings pass a later step's value on, and
    the decoder's embed a later step's new tokens at the positions after the ``past`` cached ones.

    Args:
        model: the model.
        stack: the stack (:func:`stacks`).
        shared: paths of modules held besides (the model's shared input embedding, with the encoder's).
    """

    def __init__(self, model: PreTrainedModel, stack: Stack, shared: tuple[str, ...] = ()) -> None:
        super().__init__(model, [*stack.embedding, *shared])
        self.stack = stack
        self._use_cache = "use_cache" in inspect.signature(model.get_submodule(stack.path).forward).parameters

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if later_step(value) and not self.stack.decoder:
            return value  # the encoder ran at the first step
        source, source_mask, target, target_mask, *rows = value
        inputs: dict[str, Any] = {"use_cache": False} if self._use_cache else {}
        if self.stack.decoder:
            past = target_mask.shape[1] - target.shape[1]
            states = source
            if past:  # a later step of cached decoding: the new tokens' positions follow the cached ones
                inputs["cache"] = past_length_cache(past, source_mask)
                states = source_mask.new_zeros((), dtype=torch.float32).expand(*source_mask.shape, 1)  # a stand-in
            inputs.update(encoder_hidden_states=states, encoder_attention_mask=source_mask)
            return (source, source_mask, self._embedded(target, target_mask, inputs), target_mask, *rows)
        return (self._embedded(source, source_mask, inputs), *value[1:])

    def _embedded(self, ids: Tensor, mask: Tensor, inputs: dict[str, Any]) -> Tensor:
        """The hidden states ``(N, T, H)`` the stack's forward gives its first block for ``ids`` and ``mask`` ``(N,
        T)`` and the other ``inputs``.

        Raises:
            RuntimeError: if the stack's forward never calls its first block.
        """
        stack: Any = self.hf_model.get_submodule(self.stack.path)
        # the stack is no module of this layer's, so `train()` and `eval()` do not reach it: its own dropout (BART's
        # on the embeddings) and layerdrop follow this layer's mode (its children's modes are this layer's own)
        stack.training = self.training
        first = cast(nn.ModuleList, self.hf_model.get_submodule(self.stack.blocks))[0]
        handle = first.register_forward_pre_hook(_stop, with_kwargs=True)
        layerdrop = stack.__dict__.get("layerdrop")
        if layerdrop:  # the first block's draw is its own layer's (StackBlock)
            stack.layerdrop = 0.0
        try:
            stack(input_ids=ids, attention_mask=mask, **inputs)
        except _Reached as reached:
            hidden = reached.hidden
            if self.stack.attention == "global tokens":  # the global tokens' states before the others
                assert reached.global_hidden is not None  # Pegasus-X's blocks take them
                hidden = torch.cat([reached.global_hidden, hidden], dim=1)
        else:
            raise RuntimeError(f"{type(stack).__name__}'s forward never called its first block")
        finally:
            handle.remove()
            if layerdrop:
                stack.layerdrop = layerdrop
        return hidden


class StackBlock(HFLayer):
    """One encoder or decoder block: the value to the same, the block applied to the stack's hidden states (the
    encoder's ``source``, the decoder's ``target``), with the masks rebuilt (see the module docstring) and, after a
    T5 stack's first block, the relative position bias computed from the table the first block holds. With the
    stack's ``layerdrop`` (M2M100's, Seamless's default 0.05), in training the block is skipped with that probability,
    drawn as the stack's forward draws it (``torch.rand([])`` before each block): under a pipeline once per
    micro-batch rather than once per batch, a draw of its own as a dropout mask is. In cached decoding (``rows`` at
    the value's end) a decoder block keeps its caches in :attr:`decoder_caches` and an encoder block passes a later
    step's value on (see the module docstring).

    Args:
        model: the model.
        stack: the stack.
        index: the block's index in the stack (its attention's ``layer_idx``).

    Attributes:
        decoder_caches: a decoder block's :class:`~lightning_gpipe.hf.seq2seq_cache.DecoderCaches` (not part of the
            state dict), or ``None`` (an encoder block, or a block that takes no ``cache``).
    """

    def __init__(self, model: PreTrainedModel, stack: Stack, index: int) -> None:
        block = f"{stack.blocks}.{index}"
        arguments = inspect.signature(model.get_submodule(block).forward).parameters
        self._bias = stack.bias if index and stack.bias is not None and "position_bias" in arguments else None
        self._rotary = f"{stack.path}.{ROTARY}" if stack.attention == "rotary" else None
        held = [*([f"{self._bias}.relative_attention_bias"] if self._bias else []), *filter(None, [self._rotary])]
        super().__init__(model, [block, *held])
        self.stack, self.block, self.index, self._use_cache = stack, block, index, "use_cache" in arguments
        self.layerdrop = float(getattr(model.get_submodule(stack.path), "layerdrop", 0.0) or 0.0)
        self.decoder_caches = DecoderCaches(index) if stack.decoder and "cache" in arguments else None
        self._prompts = [name for name in arguments if name in PROMPTS] if stack.attention == "prompts" else []
        self._last = index == len(cast(nn.ModuleList, model.get_submodule(stack.blocks))) - 1
        self._type = layer_type(model.get_submodule(stack.path).config, index)

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        dropped = self.training and self.layerdrop > 0.0 and bool(torch.rand([]) < self.layerdrop)
        if later_step(value) and not self.stack.decoder:
            return value  # the encoder ran at the first step
        source, source_mask, target, target_mask, *rows = value
        if dropped:  # LayerDrop, drawn as the stack's forward draws it
            return value if self.stack.decoder or not self._last else (self._given(source, source_mask), *value[1:])
        hidden = target if self.stack.decoder else source
        extra: dict[str, Any] = {"use_cache": False} if self._use_cache else {}
        extra.update(dict.fromkeys(self._prompts, None))
        if self.stack.decoder:
            mask, past = self._decoder_inputs(value, extra)
        else:
            hidden, mask, past = *self._encoder_inputs(hidden, source_mask, extra), 0
        if self._bias is not None:
            length = hidden.shape[1]
            holder = cast(Any, self.hf_model.get_submodule(self._bias))
            offset = {"past_seen_tokens": past} if past else {}
            if self.stack.attention == "local" and not self.stack.decoder:
                extra["position_bias"] = local_bias(holder, holder.block_len, mask)
            else:
                extra["position_bias"] = holder.compute_bias(length, past + length, device=hidden.device, **offset)
        if self._rotary is not None:  # the rotary cos/sin of the positions, as the stack's forward computes them
            positions = torch.arange(past, past + hidden.shape[1], device=hidden.device)[None]
            extra.update(position_ids=positions, position_embeddings=self.part(self._rotary)(hidden, positions))
        output = self.part(self.block)(hidden, attention_mask=mask, **extra)
        if self.stack.decoder:
            return (source, source_mask, output[0] if isinstance(output, tuple) else output, target_mask, *rows)
        if self.stack.attention == "global tokens":  # the global tokens' states before the others
            output = torch.cat([output[1], output[0]], dim=1)
        output = output[0] if isinstance(output, tuple) else output
        return (self._given(output, source_mask) if self._last else output, *value[1:])

    def _encoder_inputs(self, hidden: Tensor, mask: Tensor, extra: dict[str, Any]) -> tuple[Tensor, Any]:
        """An encoder block's hidden states and attention mask for the ``source`` states ``hidden`` and the source
        ``mask`` ``(N, S)`` (:func:`~lightning_gpipe.hf.seq2seq_inputs.encoder_inputs` for a stack of attention other
        than the 4-D masks'), what else it takes put in ``extra``."""
        stack = self.hf_model.get_submodule(self.stack.path)
        if self.stack.attention == "block sparse":  # full attention, as the stack's forward falls back to
            full_attention(self.part(self.block), stack.config, hidden.shape[1])
        if self.stack.attention in ("full", "prompts", "block sparse", "rotary"):
            return hidden, ENCODER_MASKS[self._type](config=stack.config, inputs_embeds=hidden, attention_mask=mask)
        return encoder_inputs(self.stack.attention, stack, hidden, mask, extra)

    def _given(self, source: Tensor, mask: Tensor) -> Tensor:
        """The encoder's output ``(N, S, H)`` of the last block's ``source`` (without Pegasus-X's global tokens and
        the positions LED and Pegasus-X pad; :func:`~lightning_gpipe.hf.seq2seq_inputs.encoder_output`)."""
        return encoder_output(self.stack.attention, self.hf_model.get_submodule(self.stack.path), source, mask)

    def _decoder_inputs(self, value: tuple[Tensor, ...], extra: dict[str, Any]) -> tuple[Any, int]:
        """A decoder block's causal mask and how many cached positions precede the new tokens (0 without a cache);
        put in ``extra``: the encoder's output and the cross-attention mask, and in cached decoding the cache of the
        value's rows (at a later step the encoder's output is a stand-in of its shape that allocates nothing: the
        cross-attention reads its cached keys and values).

        Raises:
            RuntimeError: in cached decoding, for a block that takes no ``cache``, or from
                :meth:`~lightning_gpipe.hf.seq2seq_cache.DecoderCaches.of`.
        """
        source, source_mask, hidden, target_mask, *rows = value
        config = self.hf_model.get_submodule(self.stack.path).config
        cache = None
        if rows:
            if self.decoder_caches is None:
                raise RuntimeError(f"{self.block} takes no `cache`: decode without key/value caches (kv_cache=False).")
            cache = extra["cache"] = self.decoder_caches.of(rows[0], target_mask.shape[1] - hidden.shape[1])
            if source.dim() == 1:
                source = hidden.new_zeros(()).expand(hidden.shape[0], source_mask.shape[1], hidden.shape[-1])
        mask = DECODER_MASKS[self._type](
            config=config,
            inputs_embeds=hidden,
            attention_mask=target_mask,
            cache=None if cache is None else cache.self_attention_cache,
            layer_idx=self.index,
        )
        extra["encoder_hidden_states"] = source
        extra["encoder_attention_mask"] = create_bidirectional_mask(
            config=config, inputs_embeds=hidden, attention_mask=source_mask, encoder_hidden_states=source
        )
        return mask, 0 if cache is None else cache.get_seq_length(self.index)


class StackNorm(HFLayer):
    """A stack's final norm (and T5's dropout after it), applied to the stack's hidden states in the value.

    Args:
        model: the model.
        stack: the stack (with :attr:`Stack.norm`).
    """

    def __init__(self, model: PreTrainedModel, stack: Stack) -> None:
        super().__init__(model, stack.norm)
        self.stack = stack

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        if later_step(value) and not self.stack.decoder:
            return value  # the encoder ran at the first step
        where = 2 if self.stack.decoder else 0
        hidden = value[where]
        for path in self.stack.norm:
            hidden = self.part(path)(hidden)
        return (*value[:where], hidden, *value[where + 1 :])


SCALING = "model_dim**-0.5"
"""How the T5 family's forward scales the decoder's output before the head (``sequence_output *
(self.model_dim**-0.5)``), under a condition of its config."""


def output_scale(model: nn.Module) -> float | None:
    """``d_model ** -0.5`` where the model's forward scales the decoder's output by it before the head, else ``None``:
    a class whose forward's source does (:data:`SCALING`), under ``config.scale_decoder_outputs`` where the config has
    that field (T5, umT5, LongT5), else under ``config.tie_word_embeddings`` (Switch Transformers); mT5's never does.
    The self-check proves the choice on a miniature."""
    dimension = getattr(model, "model_dim", None)
    if not isinstance(dimension, int) or SCALING not in inspect.getsource(type(model).forward).replace(" ", ""):
        return None
    config = cast(Any, model).config
    condition = getattr(config, "scale_decoder_outputs", None)
    return dimension**-0.5 if (config.tie_word_embeddings if condition is None else condition) else None


SOFTCAP = "final_logit_softcapping"
"""The decoder's config field by which T5Gemma's forward soft-caps the logits (``c * tanh(logits / c)``)."""


def output_softcap(model: nn.Module) -> float | None:
    """``c`` where the model's forward soft-caps the logits, ``c * tanh(logits / c)``, else ``None``: its decoder's
    config's :data:`SOFTCAP` where the class's forward's source names it (T5Gemma's). The self-check proves the
    choice on a miniature."""
    if SOFTCAP not in inspect.getsource(type(model).forward):
        return None
    return getattr(cast(Any, model).get_decoder().config, SOFTCAP, None)


class Seq2SeqHead(HFLayer):
    """The head: the value to logits ``(N, T, V)``: the decoder's hidden states (times ``d_model ** -0.5`` where the
    model's forward scales them, :func:`output_scale`) through ``lm_head``, plus the model's ``final_logits_bias``
    where it has one (held here under the model's name), soft-capped where the model's forward soft-caps them
    (:func:`output_softcap`).

    Args:
        model: the model.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model, ["lm_head"])
        self.scale, self.softcap = output_scale(model), output_softcap(model)
        bias = getattr(model, OUTPUT_BIAS, None)
        self.register_buffer(OUTPUT_BIAS, bias if isinstance(bias, Tensor) else None)

    def forward(self, value: tuple[Tensor, ...]) -> Tensor:
        hidden = value[2]
        if self.scale is not None:
            hidden = hidden * self.scale
        logits = self.part("lm_head")(hidden)
        bias = getattr(self, OUTPUT_BIAS)
        logits = logits if bias is None else logits + bias.to(logits.device)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def reset_parameters(self) -> None:
        """:meth:`HFLayer.reset_parameters`, and ``final_logits_bias`` zeros (as the model initialises it) unless the
        checkpoint gives it; the model then holds the new tensor too."""
        given = OUTPUT_BIAS in self._provided()
        super().reset_parameters()
        bias = getattr(self, OUTPUT_BIAS)
        if bias is not None:
            if not given:
                bias.zero_()
            self.hf_model.register_buffer(OUTPUT_BIAS, bias)  # the model's buffer is persistent


def encoder_decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the encoder-decoder layout (see the module docstring)."""
    found = stacks(model)
    assert not isinstance(found, str)  # the family takes only models of the layout
    shared = _path(model, model.get_input_embeddings())
    layers: list[nn.Module] = []
    for stack in found:
        extra = (shared,) if shared is not None and not stack.decoder and shared not in stack.embedding else ()
        count = len(cast(nn.ModuleList, model.get_submodule(stack.blocks)))
        layers += [StackEmbedding(model, stack, extra), *(StackBlock(model, stack, i) for i in range(count))]
        layers += [StackNorm(model, stack)] if stack.norm else []
    return [*layers, Seq2SeqHead(model)]
