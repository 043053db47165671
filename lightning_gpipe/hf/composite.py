"""Composite models: a language model with other towers (vision, audio) feeding it, cut as the language model is.

``transformers`` builds most image- and audio-to-text models alike (Gemma 3's ``Gemma3ForConditionalGeneration``,
GOT-OCR 2, Voxtral, Qwen2-Audio, Granite Speech...): a config with no depth of its own but the language model's
``text_config`` beside the towers' configs; the model's children its base model (``base_model_prefix``: ``model``) and
``lm_head``; the base model's the language model (``language_model``, a decoder base model built from the text config:
``embed_tokens``, ``layers``, the final norm, ``rotary_emb``) and the towers (``vision_tower``, ``audio_tower``,
``multi_modal_projector``...). For text its forward embeds the tokens with the language model's embedding, runs the
language model's blocks with the masks of the text config, its final norm and ``lm_head``: the decoder cut
(:func:`~lightning_gpipe.hf.decoder_cut.decoder_layers`) at the language model's modules, read with the text config
(:class:`TextView`), the towers held by the embedding layer (every tensor of the model is held by a layer) and run
by no text. :func:`composite_decoder` recognises the layout by structure and says why a model is not of it; the
self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves the cut on a miniature of the class, as for any decoder.
A batch carrying the towers' inputs (``pixel_values``, ``input_features``...) is refused by
:class:`~lightning_gpipe.hf.CausalLM`, naming them, rather than trained on its text alone.
"""

from __future__ import annotations

import inspect
from typing import Any, cast

from torch import nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.altup import altup_children
from lightning_gpipe.hf.decoder_cut import DecoderCut, decoder_layers
from lightning_gpipe.hf.decoder_layout import (
    ROTARY,
    base_model_reason,
    base_name,
    bidirectional,
    block_arguments_reason,
    kv_sharing_reason,
    layer_types_reason,
    per_layer_module,
)
from lightning_gpipe.hf.layer import PreTrainedModel

TEXT_CONFIG = "text_config"
"""The field of a composite config that holds its language model's config (``transformers``' convention)."""


class TextView:
    """A composite model as its language model's layers read it: :attr:`config` is the text config, every other
    attribute (its modules, ``_init_weights``...) the model's own, so the decoder layers built on it hold the model's
    modules under their paths in the model and build their masks, caches and head scaling from the text config.

    Args:
        model: the composite model.
        config: its language model's config (``model.config.text_config``).
    """

    def __init__(self, model: nn.Module, config: Any) -> None:
        self.__dict__.update(model=model, config=config)

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:  # not yet initialised (a copy being rebuilt)
            raise AttributeError(name)
        return getattr(model, name)


def text_config(config: Any) -> Any | None:
    """``config``'s language model config where it is composite (no ``num_hidden_layers`` of its own, a
    ``text_config`` with one), else ``None``."""
    own = getattr(config, "num_hidden_layers", None)
    text = getattr(config, TEXT_CONFIG, None)
    if isinstance(own, int) or not isinstance(getattr(text, "num_hidden_layers", None), int):
        return None  # a config of its own depth (a decoder's), or of towers without a language model's
    return text


def _language_model(base: nn.Module, text: Any) -> str | None:
    """The name of ``base``'s one child that is a model of ``text``'s config class (its language model), or
    ``None``."""
    found = [
        name
        for name, child in children(base).items()
        if isinstance(child, PreTrainedModel) and type(child.config) is type(text)
    ]
    return found[0] if len(found) == 1 else None


def _norm_name(language: nn.Module, text: Any) -> str:
    """The language model's final norm: the entry after the blocks of the text config's declared plan
    (``base_model_pp_plan``), else its one child named ``...norm`` besides ``embed_tokens``, ``layers`` and
    ``rotary_emb`` (Persimmon's ``final_layernorm``); or why there is none, as a sentence starting ``"not "``."""
    plan = list(getattr(text, "base_model_pp_plan", None) or {})
    if plan[:2] == ["embed_tokens", "layers"] and len(plan) == 3:
        return plan[2]
    norms = [name for name in children(language) if name.endswith("norm")]
    if len(norms) != 1:
        return f"not one final norm among its children {sorted(children(language))}"
    return norms[0]


def _text_cut(model: nn.Module, prefix: str, language: str, text: Any) -> DecoderCut | str:
    """The cut of the language model at ``prefix.language`` (its ``embed_tokens``, ``layers``, final norm and
    ``rotary_emb``, and its per-layer embedding modules, :func:`~lightning_gpipe.hf.decoder_layout.per_layer_module`:
    Gemma 4's; AltUp's widening and narrowing, :func:`~lightning_gpipe.hf.altup.altup_children`: Gemma 3n's; the base
    model's other children held by the embedding layer), or why not."""
    path = f"{prefix}.{language}"
    module = model.get_submodule(path)
    norm = _norm_name(module, text)
    if norm.startswith("not "):
        return f"`{path}` holds {norm}"
    inner = sorted(name for name, child in children(module).items() if child is not None)
    per_layer = [name for name in inner if per_layer_module(module, name)]  # Gemma 4's per-layer embeddings
    altup = altup_children(text, module)  # Gemma 3n's
    known = [*per_layer, *(altup or ())]
    expected = sorted(["embed_tokens", "layers", norm, *([ROTARY] if ROTARY in inner else []), *known])
    if inner != expected:
        return f"`{path}` holds {inner}, not exactly {expected}"
    blocks = module.get_submodule("layers")
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != text.num_hidden_layers:
        return f"`{path}.layers` is not an nn.ModuleList of the text config's num_hidden_layers blocks"
    towers = tuple(
        f"{prefix}.{name}"
        for name, child in children(model.get_submodule(prefix)).items()
        if name != language and child is not None
    )
    rotary = f"{path}.{ROTARY}" if ROTARY in inner else None
    return DecoderCut(
        f"{path}.embed_tokens", None, f"{path}.layers", rotary, f"{path}.{norm}", "lm_head",
        per_layer=tuple(f"{path}.{name}" for name in per_layer), held=towers,
        altup=None if altup is None else (f"{path}.{altup[0]}", f"{path}.{altup[1]}"),
    )  # fmt: skip


def composite_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is a composite of the layout in the module docstring, else why not: its config holds
    a language model's ``text_config`` (:func:`text_config`), its children are exactly its base model and
    ``lm_head``, the base model holds one model of the text config's class whose modules are a decoder's
    (:func:`_text_cut`), and the text config's layer types and blocks are ones the adapter rebuilds and calls
    (as for the standard layout); a load-balancing loss of its language model is not carried."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    text = text_config(model.config)
    if text is None:
        return f"its config holds no language model's `{TEXT_CONFIG}` beside towers, and has a depth of its own"
    reason = base_model_reason(model)
    if reason is not None:
        return reason
    prefix = base_name(model)
    language = _language_model(model.get_submodule(prefix), text)
    if language is None:
        return f"`{prefix}` holds no one model of its {type(text).__name__} (its language model)"
    cut = _text_cut(model, prefix, language, text)
    if isinstance(cut, str):
        return cut
    if getattr(text, "output_router_logits", False):
        return "its language model adds a load-balancing loss (output_router_logits=True), which it does not carry"
    embedders = [path for path in cut.held if _first_argument(model.get_submodule(path)) == "input_ids"]
    if embedders:
        return (
            f"its base model holds {embedders} beside its language model, which take token ids: its forward embeds"
            " text with them too (Gemma 3n's, masked out: their weights get zero gradients), which the backbone does"
            " not run"
        )
    if bidirectional(text):
        return "its text config has use_bidirectional_attention=True (a bidirectional encoder, not a causal LM)"
    rotary = None if cut.rotary is None else model.get_submodule(cut.rotary)
    first = cast(nn.ModuleList, model.get_submodule(cut.blocks))[0]
    return layer_types_reason(text, rotary) or kv_sharing_reason(text) or block_arguments_reason(first, text)


def _first_argument(module: nn.Module) -> str | None:
    """The name of the first argument of ``module``'s forward, or ``None``."""
    return next(iter(inspect.signature(module.forward).parameters), None)


def composite_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a composite model (:func:`composite_decoder`): the decoder cut at its language model's
    modules, read with the text config (:class:`TextView`), the towers held by the embedding layer."""
    text = text_config(model.config)
    prefix = base_name(model)
    language = _language_model(model.get_submodule(prefix), text)
    cut = _text_cut(model, prefix, cast(str, language), text)
    assert isinstance(cut, DecoderCut)  # the family takes only models of the layout
    return decoder_layers(cast(PreTrainedModel, TextView(model, text)), cut)


TEXT_INPUTS = frozenset(("input_ids", "attention_mask", "position_ids", "labels"))
"""What a decoder's backbone and loss take of a batch (:class:`~lightning_gpipe.hf.CausalLM`)."""


def unused_inputs(model: nn.Module, batch: dict[str, Any]) -> list[str]:
    """The keys of ``batch`` that ``model``'s forward takes and a decoder's backbone and loss do not
    (:data:`TEXT_INPUTS`): a composite model's towers' inputs (``pixel_values``, ``input_features``...), Gemma 3's
    ``token_type_ids`` (its image tokens' bidirectional attention), anything the model's forward would compute with and
    the backbone would drop. Keys its forward does not name (``num_targets``) are not the model's."""
    named = inspect.signature(type(model).forward).parameters
    return sorted(key for key in batch if key in named and key not in TEXT_INPUTS)
