"""The GPT-2-like decoders that declare no pipeline plan, recognised by structure: Bloom, Falcon, MPT, GPT-BigCode
(StarCoder), XGLM.

Their base model (under ``base_model_prefix``, beside ``lm_head``) holds, in order: the token embedding (the model's
``get_input_embeddings()``), at most one position embedding taking the positions (GPT-BigCode's ``wpe``, XGLM's
sinusoidal ``embed_positions``), at most one module on the embeddings (Bloom's ``word_embeddings_layernorm``,
GPT-BigCode's ``drop``), the blocks (an ``nn.ModuleList`` of ``num_hidden_layers``), the final norm, and optionally the
rotary embedding (Falcon's ``rotary_emb``); besides, buffers the model does not save (GPT-BigCode's causal ``bias``,
which its forward never reads). :func:`gpt2_like_decoder` recognises that layout, or says why a model is not of it;
:func:`gpt2_like_layers` cuts it into :class:`~lightning_gpipe.hf.decoder.DecoderEmbedding`, one
:class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` per block, :class:`~lightning_gpipe.hf.decoder.FinalNorm` and
:class:`~lightning_gpipe.hf.decoder.Head`.

Each block layer computes what the model's forward gives its blocks besides the hidden states, the mask and the
cache, where the block asks for it (:data:`ARGUMENTS`): ALiBi biases from the ``(N, S)`` mask with the base model's
own ``build_alibi_tensor`` (Bloom's ``alibi``; Falcon's ``None`` with ``config.alibi=False``), MPT's
``position_bias`` (its base model's ``build_mpt_alibi_tensor``, with the boolean mask its attention fills), the rotary
cos/sin (Falcon). What stays refused: Falcon with ``alibi=True`` (its forward folds the ALiBi biases into the 4-D mask
it gives every block), cross-attention (``add_cross_attention``), XGLM's ``layerdrop`` (layers skipped at random), and
blocks that carry a state (recurrent layer types or an ``nn.Conv1d`` in a block: Mamba, Jamba, LFM2's ``conv``
layers...), whose state an attention block's key/value cache does not hold.
The self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on a miniature before step 1.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from torch import nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.decoder import DecoderEmbedding, FinalNorm, GPT2LikeBlock, Head
from lightning_gpipe.hf.decoder_layout import ADVICE, ROTARY, base_model_reason, layer_types_reason
from lightning_gpipe.hf.layer import PreTrainedModel
from lightning_gpipe.hf.masks import unpackable_layer_types

ARGUMENTS = frozenset(
    ("hidden_states", "attention_mask", "layer_past", "cache", "use_cache", "output_attentions", "position_ids")
    + ("alibi", "position_bias", "position_embeddings", "encoder_hidden_states", "encoder_attention_mask")
)
"""The named arguments a GPT-2-like block may take: the hidden states, the 4-D mask, the cache (``layer_past`` or
``cache``) and whether to use it, the positions, ALiBi biases (``alibi``: Bloom, Falcon; ``position_bias``: MPT), the
rotary cos/sin (``position_embeddings``: Falcon), and the cross-attention inputs, left at ``None`` (a causal LM has no
encoder)."""


def _base(model: nn.Module) -> nn.Module:
    return model.get_submodule(cast(Any, model).base_model_prefix)


def _parts(model: nn.Module) -> dict[str, list[str]] | str:
    """The base model's children by role, ``{"tokens", "positions", "on_embeddings", "blocks", "norm",
    "rotary"}`` (names, each list at most one long but ``rotary``), or why they are not of the layout."""
    base, config = _base(model), cast(Any, model).config
    named = [(name, child) for name, child in children(base).items() if child is not None]
    lists = [i for i, (_, child) in enumerate(named) if isinstance(child, nn.ModuleList)]
    if len(lists) != 1 or len(cast(nn.ModuleList, named[lists[0]][1])) != config.num_hidden_layers:
        return f"`{model.base_model_prefix}` holds no one nn.ModuleList of num_hidden_layers blocks"
    before, after = named[: lists[0]], [(n, c) for n, c in named[lists[0] + 1 :] if n != ROTARY]
    tokens = [name for name, child in before if child is cast(Any, model).get_input_embeddings()]
    positions = [name for name, child in before if name not in tokens and _takes_positions(child)]
    rest = [name for name, _ in before if name not in tokens + positions]
    if len(tokens) != 1 or len(positions) > 1 or len(rest) > 1 or len(after) != 1:
        return (
            f"`{model.base_model_prefix}` holds {[name for name, _ in named]}, not the token embedding, at most one"
            " position embedding and one module on the embeddings, the blocks, the final norm (and a rotary_emb)"
        )
    rotary = [ROTARY] if ROTARY in dict(named) else []
    blocks, norm = [named[lists[0]][0]], [after[0][0]]
    return {"tokens": tokens, "positions": positions, "on_embeddings": rest, "blocks": blocks, "norm": norm,
            "rotary": rotary}  # fmt: skip


def _takes_positions(module: nn.Module) -> bool:
    """Whether ``module`` embeds positions: an ``nn.Embedding`` or a module whose forward takes ``position_ids``."""
    if isinstance(module, nn.Embedding):
        return True
    return "position_ids" in inspect.signature(module.forward).parameters


def _config_reason(model: nn.Module, blocks: nn.ModuleList) -> str | None:
    """Why the model's forward gives its blocks what the adapter does not (see the module docstring), or ``None``."""
    config, base, block = cast(Any, model).config, _base(model), blocks[0]
    arguments = inspect.signature(block.forward).parameters
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    extra = [p.name for p in arguments.values() if p.kind in named and p.name not in ARGUMENTS]
    if extra:
        return f"its blocks ({type(block).__name__}) take {extra}, which the adapter does not compute. {ADVICE}"
    if "alibi" in arguments and not callable(getattr(base, "build_alibi_tensor", None)):
        if getattr(config, "alibi", False):
            return "alibi=True: its forward folds the ALiBi biases into the 4-D mask it gives every block"
    if "position_bias" in arguments and not callable(getattr(base, "build_mpt_alibi_tensor", None)):
        return "its blocks take position_bias, and its base model has no build_mpt_alibi_tensor to compute it"
    unknown = layer_types_reason(config)
    if unknown is not None:
        return unknown
    recurrent = unpackable_layer_types(config)
    if recurrent or any(isinstance(module, nn.Conv1d) for module in blocks.modules()):
        return (
            f"its blocks carry a state ({recurrent or 'a convolution'}: a recurrent layer), which the cache of an"
            " attention block does not hold"
        )
    if getattr(config, "add_cross_attention", False):
        return "add_cross_attention=True: its blocks attend to an encoder's output, which a causal LM lacks"
    if getattr(config, "layerdrop", 0.0):
        return f"layerdrop={config.layerdrop}: its forward skips layers at random in training"
    return None


def gpt2_like_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the GPT-2-like layout (see the module docstring), else why not: its children
    exactly the base model and ``lm_head``, the base model's the modules named there, every buffer it holds itself
    unsaved, its blocks taking only :data:`ARGUMENTS`, and its config nothing the adapter does not carry (ALiBi
    folded into the mask, cross-attention, layer drop)."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    reason = base_model_reason(model)
    if reason is not None:
        return reason
    parts = _parts(model)
    if isinstance(parts, str):
        return parts
    base = _base(model)
    saved = [name for name, _ in base.named_buffers(recurse=False) if name not in _unsaved(base)]
    if saved:
        return f"`{model.base_model_prefix}` holds the buffers {saved} itself, which no layer can hold"
    blocks = cast(nn.ModuleList, base.get_submodule(parts["blocks"][0]))
    return _config_reason(model, blocks)


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
    has one, XGLM's), one :class:`~lightning_gpipe.hf.decoder.GPT2LikeBlock` per block, the final norm, the head."""
    parts = _parts(model)
    assert not isinstance(parts, str)  # the family takes only models of the layout
    prefix, base = model.base_model_prefix, _base(model)
    path = {role: [f"{prefix}.{name}" for name in names] for role, names in parts.items()}
    dropout = getattr(base, "dropout", None)
    rotary = next(iter(path["rotary"]), None)
    blocks = path["blocks"][0]
    return [
        DecoderEmbedding(
            model,
            path["tokens"][0],
            next(iter(path["positions"]), None),
            next(iter(path["on_embeddings"]), None),
            dropout_p=float(dropout) if isinstance(dropout, (int, float)) else None,
        ),
        *(GPT2LikeBlock(model, f"{blocks}.{i}", rotary) for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, path["norm"][0]),
        Head(model, "lm_head"),
    ]
