"""The decoders that declare no pipeline plan and are laid out as GPT-2 is, recognised by structure: Bloom, Falcon,
MPT, GPT-BigCode (StarCoder), XGLM, Moshi; and the recurrent and hybrid ones of that layout, whose layers carry a
state: Mamba, Mamba-2, Falcon-Mamba, Jamba, Bamba, LFM2, Nemotron-H, Falcon-H1, RWKV, xLSTM, Zamba, Zamba2.

Their base model (under ``base_model_prefix``, beside ``lm_head``) holds, in order: the token embedding (the model's
``get_input_embeddings()``), at most one position embedding taking the positions (GPT-BigCode's ``wpe``, XGLM's
sinusoidal ``embed_positions``), at most one module on the embeddings (Bloom's ``word_embeddings_layernorm``,
GPT-BigCode's ``drop``), the blocks (an ``nn.ModuleList`` of ``num_hidden_layers``), the final norm, and optionally the
rotary embedding (Falcon's ``rotary_emb``; LFM2-MoE's ``pos_emb``, known by its ``inv_freq``); besides, buffers the
model does not save (GPT-BigCode's causal ``bias``, which its forward never reads). :func:`gpt2_like_decoder`
recognises that layout, or says why a model is not of it;
:func:`gpt2_like_layers` cuts it into :class:`~lightning_gpipe.hf.decoder.DecoderEmbedding`, one
:class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` per block, :class:`~lightning_gpipe.hf.decoder.FinalNorm` and
:class:`~lightning_gpipe.hf.decoder.Head`.

Each block layer computes what the model's forward gives its blocks besides the hidden states, the mask and the
cache, where the block asks for it (:data:`ARGUMENTS`): ALiBi biases from the ``(N, S)`` mask with the base model's
own ``build_alibi_tensor`` (Bloom's ``alibi``; Falcon's ``None`` with ``config.alibi=False``; with ``alibi=True``
its modeling module's ``build_alibi_tensor``, folded into the 4-D mask as its forward folds them), MPT's
``position_bias`` (its base model's ``build_mpt_alibi_tensor``, with the boolean mask its attention fills), the rotary
cos/sin (Falcon, Bamba, LFM2). The mask is the one ``transformers`` declares for the block's layer type
(:mod:`lightning_gpipe.hf.masks`): for a recurrent layer (``linear_attention``: a Mamba mixer; ``conv``: LFM2's short
convolution) the ``(N, S)`` padding mask, with which the mixer zeroes the padding before its convolution and scan. In
training no cache is given, so every row's state starts at zero and runs along the row, as in the model's forward (a
packed row's documents would share it: :class:`~lightning_gpipe.hf.module.CausalLM` refuses packed batches for
these); in cached decoding the block's ``transformers.DynamicCache`` keeps the convolution and recurrent states of its
rows (:class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`).

Blocks are told apart by what they take, not by their names: the hidden states as their first argument whatever it
is called (CTRL's ``x``, RWKV's ``hidden``); ``state``, a recurrent state of their own (RWKV's, xLSTM's), ``None`` as
the model's forward gives it in training (fresh per sequence; cached decoding, which would not keep it, is refused);
an argument the base model's forward never names keeps its default (Moshi's ``codebook_idx``); a ``hybrid`` layer type
(Falcon-H1: a Mamba-2 mixer beside attention) gets the attention mask and the recurrent one under its other ``..._mask``
argument; the layer types without attention (Nemotron-H's ``mlp``, ``moe``) get no mask. Zamba's and Zamba2's hybrid
layers add one attention block, shared by all of them (its weights tied: one ``nn.Parameter`` in several layers, which
the strategy ties across stages), to a Mamba layer; that block reads the embeddings beside the hidden states
(``original_hidden_states``: the embedding layer passes them on in the value, every block layer carries them) and is
told its layer's index (``layer_idx``: Zamba2 picks its per-layer adapters by it), and their blocks take the causal mask
as ``causal_mask`` and the recurrent one as ``attention_mask`` (:data:`SHARED_BLOCK`). Buffers a base model sets in
its blocks at its own initialisation (Falcon-H1's ``mup_vector``) are set again on a stage
(:meth:`~lightning_gpipe.hf.decoder.GPT2LikeBlock.reset_parameters`); the model's output head is its
``get_output_embeddings()`` (RWKV's ``head``); a model without a final norm (OpenAI GPT's post-norm blocks) has none.

What stays refused, naming why: ``alibi=True`` without a ``build_alibi_tensor`` of the base model or its modeling
module, cross-attention (``add_cross_attention``), XGLM's ``layerdrop`` (layers skipped at random); a
load-balancing loss (``output_router_logits=True``: Jamba's experts), which the layout does not carry; hybrid blocks
taking more than one recurrent mask or other arguments; buffers of the base model's own that its forward reads
(CTRL's ``pos_encoding``, RecurrentGemma's ``normalizer``: both taken by :mod:`lightning_gpipe.hf.decoder_stack`),
which the layout's embedding does not compute; and an ``nn.Conv1d`` in a block whose layer types name no recurrent
layer (a state no cache would keep).
The self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on a miniature before step 1.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, cast

from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.decoder import EMBEDDINGS, DecoderEmbedding, FinalNorm, GPT2LikeBlock, Head
from lightning_gpipe.hf.decoder_cut import head_scaling, own_field
from lightning_gpipe.hf.decoder_layout import (
    ADVICE,
    ROTARY,
    base_model_reason,
    base_name,
    block_loops_reason,
    forward_names,
    layer_types_reason,
)
from lightning_gpipe.hf.layer import PreTrainedModel
from lightning_gpipe.hf.masks import HYBRID, layer_type, unpackable_layer_types
from lightning_gpipe.hf.moe import adds_load_balancing_loss

ARGUMENTS = frozenset(
    ("hidden_states", "attention_mask", "layer_past", "cache", "use_cache", "output_attentions", "position_ids")
    + ("alibi", "position_bias", "position_embeddings", "encoder_hidden_states", "encoder_attention_mask", "state")
)
"""The named arguments a GPT-2-like block may take: the hidden states, the 4-D mask, the cache (``layer_past`` or
``cache``) and whether to use it, the positions, ALiBi biases (``alibi``: Bloom, Falcon; ``position_bias``: MPT), the
rotary cos/sin (``position_embeddings``: Falcon), and the cross-attention inputs, left at ``None`` (a causal LM has no
encoder)."""


SHARED_BLOCK = frozenset((EMBEDDINGS, "layer_idx"))
"""What the blocks of the hybrids sharing one attention block across their layers take besides :data:`ARGUMENTS`
(Zamba's, Zamba2's): the embeddings, carried beside the hidden states (the shared block concatenates them to its
input), and the block's index in the model (which Zamba2's shared block picks its per-layer adapters by)."""


def _base(model: nn.Module) -> nn.Module:
    return model.get_submodule(base_name(model))


def _head(model: nn.Module) -> str:
    """The name of ``model``'s child that is its output head (``get_output_embeddings()``: ``lm_head``, RWKV's
    ``head``), ``lm_head`` where none is."""
    head = cast(Any, model).get_output_embeddings()
    return next((n for n, child in children(model).items() if child is head and head is not None), "lm_head")


def hidden_name(block: nn.Module) -> str:
    """The name of the first argument of ``block``'s forward, the hidden states it is given positionally
    (``hidden_states``; CTRL's ``x``, RWKV's ``hidden``)."""
    return next(iter(inspect.signature(block.forward).parameters))


def _parts(model: nn.Module) -> dict[str, list[str]] | str:
    """The base model's children by role, ``{"tokens", "positions", "on_embeddings", "blocks", "norm",
    "rotary"}`` (names, each list at most one long), or why they are not of the layout."""
    base, config = _base(model), cast(Any, model).config
    named = [(name, child) for name, child in children(base).items() if child is not None]
    lists = [i for i, (_, child) in enumerate(named) if isinstance(child, nn.ModuleList)]
    if len(lists) != 1 or len(cast(nn.ModuleList, named[lists[0]][1])) != config.num_hidden_layers:
        return f"`{model.base_model_prefix}` holds no one nn.ModuleList of num_hidden_layers blocks"
    rotary = [name for name, child in named if _is_rotary(name, child)]
    before = [(n, c) for n, c in named[: lists[0]] if n not in rotary]
    after = [(n, c) for n, c in named[lists[0] + 1 :] if n not in rotary]
    tokens = [name for name, child in before if child is cast(Any, model).get_input_embeddings()]
    positions = [name for name, child in before if name not in tokens and _takes_positions(child)]
    rest = [name for name, _ in before if name not in tokens + positions]
    masked = [name for name, child in before if "attention_mask" in inspect.signature(child.forward).parameters]
    if masked:  # BioGPT's positions numbered from the mask: the decoder stack's embedding runs its forward
        return f"`{model.base_model_prefix}`'s {masked} take the attention mask, which the layout does not give them"
    if len(tokens) != 1 or len(positions) > 1 or len(rest) > 1 or len(after) > 1:
        return (
            f"`{model.base_model_prefix}` holds {[name for name, _ in named]}, not the token embedding, at most one"
            " position embedding and one module on the embeddings, the blocks, a final norm (and a rotary_emb)"
        )
    if len(rotary) > 1:
        return f"`{model.base_model_prefix}` holds the rotary embeddings {rotary}, not one"
    blocks, norm = [named[lists[0]][0]], [name for name, _ in after]
    return {"tokens": tokens, "positions": positions, "on_embeddings": rest, "blocks": blocks, "norm": norm,
            "rotary": rotary}  # fmt: skip


def _is_rotary(name: str, module: nn.Module) -> bool:
    """Whether ``module`` is the base model's rotary embedding: named ``rotary_emb``, or holding the inverse
    frequencies (``inv_freq``) under another name (LFM2-MoE's ``pos_emb``)."""
    return name == ROTARY or isinstance(getattr(module, "inv_freq", None), Tensor)


def _takes_positions(module: nn.Module) -> bool:
    """Whether ``module`` embeds positions: an ``nn.Embedding`` or a module whose forward takes ``position_ids``."""
    if isinstance(module, nn.Embedding):
        return True
    return "position_ids" in inspect.signature(module.forward).parameters


def _gives(base: nn.Module, name: str) -> bool:
    """Whether the forward of ``base`` (decorators unwrapped, nested functions included) names ``name`` anywhere: as
    a variable, an attribute or a keyword. A block argument it never names keeps its default in its blocks (Moshi's
    ``codebook_idx``, which only its depth decoder gives); the self-check proves that default right."""

    def names(code: Any) -> set[str]:
        found = {*code.co_names, *code.co_varnames}
        for constant in code.co_consts:  # keyword names of calls, and nested functions' code
            if isinstance(constant, (str, tuple)):
                items = constant if isinstance(constant, tuple) else (constant,)
                found |= {item for item in items if isinstance(item, str)}
            elif hasattr(constant, "co_names"):
                found |= names(constant)
        return found

    return name in names(inspect.unwrap(type(base).forward).__code__)


def _config_reason(model: nn.Module, blocks: nn.ModuleList) -> str | None:
    """Why the model's forward gives its blocks what the adapter does not (see the module docstring), or ``None``."""
    config, base, block = cast(Any, model).config, _base(model), blocks[0]
    arguments = inspect.signature(block.forward).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    hybrid = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)} & set(HYBRID))
    masks = {name for name in arguments if name.endswith("_mask") and name not in ARGUMENTS} if hybrid else set()
    if hybrid and len(masks) != 1:
        return (
            f"its layer types {hybrid} take an attention and a recurrent mask at once, but its blocks"
            f" ({type(block).__name__}) take {sorted(masks)} besides attention_mask, not one recurrent mask"
        )
    given = ARGUMENTS | masks | {hidden_name(block)} | SHARED_BLOCK
    extra = [p.name for p in arguments.values() if p.kind in named and p.name not in given and _gives(base, p.name)]
    if extra:
        return f"its blocks ({type(block).__name__}) take {extra}, which the adapter does not compute. {ADVICE}"
    builders = (base, sys.modules.get(type(base).__module__))  # Bloom's method, Falcon's module function
    if "alibi" in arguments and getattr(config, "alibi", False):
        if not any(callable(getattr(owner, "build_alibi_tensor", None)) for owner in builders):
            return "alibi=True, and neither its base model nor its modeling module has a build_alibi_tensor"
    if "position_bias" in arguments and not callable(getattr(base, "build_mpt_alibi_tensor", None)):
        return "its blocks take position_bias, and its base model has no build_mpt_alibi_tensor to compute it"
    unknown = layer_types_reason(config)
    if unknown is not None:
        return unknown
    if not unpackable_layer_types(config) and any(isinstance(module, nn.Conv1d) for module in blocks.modules()):
        return (
            "its blocks hold a convolution (nn.Conv1d), which carries a state from token to token, but its layer types"
            " name no recurrent layer (linear_attention, conv...) whose state the cache would keep"
        )
    router = router_loss_reason(model)
    if router is not None:
        return router
    if getattr(config, "add_cross_attention", False):
        return "add_cross_attention=True: its blocks attend to an encoder's output, which a causal LM lacks"
    if getattr(config, "layerdrop", 0.0):
        return f"layerdrop={config.layerdrop}: its forward skips layers at random in training"
    return None


def router_loss_reason(model: nn.Module) -> str | None:
    """``None`` unless ``model``'s forward adds a load-balancing loss (``output_router_logits=True``: Jamba's experts),
    which neither this layout nor the decoder stack's carries through the pipeline; else why, and what to do."""
    if getattr(cast(Any, model).config, "output_router_logits", False) and adds_load_balancing_loss(type(model)):
        return (
            "output_router_logits=True: its forward adds a load-balancing loss, which neither the GPT-2-like layout"
            " nor the decoder stack carries through the pipeline (Jamba's experts): train without it,"
            " overrides={'output_router_logits': False}"
        )
    return None


def gpt2_like_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the GPT-2-like layout (see the module docstring), else why not: its children
    exactly the base model and ``lm_head``, the base model's the modules named there, every buffer it holds itself
    unsaved, its blocks taking only :data:`ARGUMENTS` and run in one loop
    (:func:`~lightning_gpipe.hf.decoder_layout.block_loops_reason`), and its config nothing the adapter does not carry
    (ALiBi folded into the mask, cross-attention, layer drop)."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    reason = base_model_reason(model, _head(model))
    if reason is not None:
        return reason
    parts = _parts(model)
    if isinstance(parts, str):
        return parts
    base = _base(model)
    saved = [name for name, _ in base.named_buffers(recurse=False) if name not in _unsaved(base)]
    if saved:
        return f"`{model.base_model_prefix}` holds the buffers {saved} itself, which no layer can hold"
    read = sorted(_unsaved(base) & set(forward_names(base)))
    if read:  # CTRL's sinusoidal `pos_encoding`, RecurrentGemma's `normalizer`: not the layout's embedding
        return (
            f"its forward reads the buffers {read} that `{model.base_model_prefix}` holds itself, unsaved, which"
            " the layout's embedding does not compute"
        )
    blocks = cast(nn.ModuleList, base.get_submodule(parts["blocks"][0]))
    return block_loops_reason(base, parts["blocks"][0]) or _config_reason(model, blocks)


def unsaved_buffers(model: nn.Module) -> set[str]:
    """The names in ``model`` of the buffers its base model holds itself and does not save (GPT-BigCode's causal
    ``bias``), which no backbone layer holds: the layout's forward never reads them (the self-check proves it)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module):
        return set()
    return {f"{prefix}.{name}" for name in _unsaved(base)}


def _unsaved(module: nn.Module) -> set[str]:
    """The names of the buffers ``module`` holds itself (not its children) that its state dict leaves out."""
    own = {name for name, _ in module.named_buffers(recurse=False)}
    return own - set(module.state_dict(keep_vars=True))


def gpt2_like_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the GPT-2-like layout (:func:`gpt2_like_decoder`): the embeddings (with the
    position embedding, the module on the embeddings, and the base model's own ``dropout`` probability where it
    has one, XGLM's; a multiplier, Granite-MoE-Hybrid's ``embedding_multiplier``), one
    :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` per block, the final norm, the head (scaled as the config
    declares, :func:`~lightning_gpipe.hf.decoder_cut.head_scaling`: Granite-MoE-Hybrid's ``logits_scaling``)."""
    parts = _parts(model)
    assert not isinstance(parts, str)  # the family takes only models of the layout
    prefix, base = base_name(model), _base(model)
    path = {role: [f"{prefix}.{name}" for name in names] for role, names in parts.items()}
    dropout = getattr(base, "dropout", None)
    rotary = next(iter(path["rotary"]), None)
    blocks = path["blocks"][0]
    hidden_divisor, head = head_scaling(model.config)
    modules = cast(nn.ModuleList, model.get_submodule(blocks))
    embeddings = any(EMBEDDINGS in inspect.signature(block.forward).parameters for block in modules)
    return [
        DecoderEmbedding(
            model,
            path["tokens"][0],
            next(iter(path["positions"]), None),
            next(iter(path["on_embeddings"]), None),
            multiplier=own_field(model.config, "embedding_multiplier"),
            dropout_p=float(dropout) if isinstance(dropout, (int, float)) else None,
            pass_embeddings=embeddings,
        ),
        *(GPT2LikeBlock(model, f"{blocks}.{i}", rotary) for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, next(iter(path["norm"]), None), divisor=hidden_divisor),
        Head(model, _head(model), **head),
    ]
