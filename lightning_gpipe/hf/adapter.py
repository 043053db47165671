"""A loaded Hugging Face ``transformers`` model as the backbone contract: one ``nn.Sequential`` of tensor-only layers.

:func:`to_sequential` returns embeddings -> one layer per decoder (or encoder) block -> final norm -> head. The
layers hold the model's own modules (no weight is copied): each layer holds its modules under their paths in the
model, so a layer's state-dict names are the model's (``backbone.3.model.layers.2.mlp.up_proj.weight`` is
``model.layers.2.mlp.up_proj.weight`` of the model, behind the layer's ``backbone.3.`` prefix), and a parameter the
model ties (input embedding and output projection) is one ``nn.Parameter`` in two layers, which the strategy's tie
mechanism (:mod:`lightning_gpipe.engine.ties`) finds by itself.

Which layers a model is cut into is its :class:`Family`'s business. Models are recognised by what ``transformers``
declares and by their structure, not their class name: first the pipeline plan a decoder declares (below), then the
standard decoder layout of ``transformers`` 5 (:mod:`lightning_gpipe.hf.decoder_layout`), the GPT-2-like decoders
that declare no plan (:mod:`lightning_gpipe.hf.gpt2_like`: Bloom, Falcon, MPT, GPT-BigCode, XGLM; Mamba, Jamba and the
other recurrent and hybrid decoders laid out alike), the causal LMs of one decoder stack
(:mod:`lightning_gpipe.hf.decoder_stack`: OPT, BioGPT, BART's decoder...), the BERT-style causal-LM heads with
``is_decoder=True`` (:mod:`lightning_gpipe.hf.causal_encoder`), the BERT-style encoders
(:mod:`lightning_gpipe.hf.encoder`) and the encoder-decoders (:mod:`lightning_gpipe.hf.seq2seq`); GPT-2 is a family by
name, and :func:`register_family` adds more.
Before a class is cut for the first time in a process, the self-check (:mod:`lightning_gpipe.hf.selfcheck`) proves
its cut on a miniature built from the same config, so a class that looks standard and is not is refused rather than
trained
wrongly. A ``peft`` model is cut as the model inside it (:mod:`lightning_gpipe.hf.lora`).

**The declared plan.** Since ``transformers`` PR #36091 (2025) a config may carry ``base_model_pp_plan``, which maps
the base model's children in order to the names of what each takes and gives (Llama's: ``{"embed_tokens":
(["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states", "attention_mask"], ["hidden_states"]), "norm":
(["hidden_states"], ["hidden_states"])}``), and a causal-LM class a ``_pp_plan`` for its head (``{"lm_head":
(["hidden_states"], ["logits"])}``). ``PreTrainedModel.pp_plan`` merges them under the base model's attribute name;
it is the library's own contract for pipeline parallelism (its pipeline inference and vLLM's ``transformers`` backend
read it), and it names the modules by the model's own names: GPT-NeoX's ``embed_in``, ``emb_dropout``, ``layers``,
``final_layer_norm``; Phi's ``embed_tokens``, ``embed_dropout``, ``layers``, ``final_layernorm``; CodeGen's and
GPT-J's ``wte``, ``drop``, ``h``, ``ln_f``. :func:`declared_cut` reads it into a
:class:`~lightning_gpipe.hf.decoder_cut.DecoderCut`: the embedding (the entry that takes ``input_ids``), at most one
module on the embeddings before the blocks, the blocks (the ``nn.ModuleList``), the final norm and the head (the
entry that gives ``logits``). Of the base model's modules the plan leaves out, the adapter takes those it knows what
the forward does with (:func:`_left_out`): the rotary embedding (``rotary_emb``: every block's layer rebuilds its
cos/sin), modules on ``(input_ids, inputs_embeds)`` (Phi-4-multimodal), rotary modules per layer theta
(Granite-SWA), per-layer embeddings (Gemma 4), the collapse of hyper-connection streams (HY-V4), the modules that
widen the embeddings into AltUp's predictions and narrow them back (Gemma 3n, :mod:`lightning_gpipe.hf.altup`) and
modules without tensors; anything else is refused. The blocks are called as the standard layout's, with what the
config declares around them (:func:`~lightning_gpipe.hf.decoder_cut.decoder_layers`). Where a class declares no plan,
or one the adapter cannot follow, the structure decides; a plan and a structure that both take a model must cut it
alike; the self-check proves whichever cut on a miniature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from lightning_gpipe.hf import lora, selfcheck
from lightning_gpipe.hf.altup import altup_children
from lightning_gpipe.hf.causal_encoder import causal_encoder, causal_encoder_layers
from lightning_gpipe.hf.composite import composite_decoder, composite_layers
from lightning_gpipe.hf.decoder_cut import (
    DecoderCut,
    decoder_layers,
    gpt2_layers,
    standard_cut,
    standard_decoder_layers,
    sublayers,
)
from lightning_gpipe.hf.decoder_layout import (
    ROTARY,
    bidirectional,
    block_arguments_reason,
    kv_sharing_reason,
    layer_types_reason,
    per_layer_module,
    standard_decoder,
    theta_rotaries,
)
from lightning_gpipe.hf.decoder_stack import decoder_stack, decoder_stack_layers
from lightning_gpipe.hf.encoder import standard_encoder, standard_encoder_layers
from lightning_gpipe.hf.gpt2_like import gpt2_like_decoder, gpt2_like_layers, unsaved_buffers
from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel, UnsupportedModelError
from lightning_gpipe.hf.seq2seq import SEQ2SEQ_INPUTS, encoder_decoder, encoder_decoder_layers

# ------------------------------------------------------------------ the pipeline plan transformers declares


def plan_of(model: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """``model``'s declared pipeline plan (``PreTrainedModel.pp_plan``: the class's ``_pp_plan`` and the config's
    ``base_model_pp_plan`` under the base model's name), ``{path: (inputs, outputs)}``; empty when it declares
    none."""
    plan = getattr(model, "pp_plan", None) or {}
    return {path: (list(io[0]), list(io[1])) for path, io in plan.items()}


def declared_cut(model: nn.Module) -> DecoderCut | str:
    """The cut ``model``'s declared plan (:func:`plan_of`) gives, or why the plan gives none: no plan, a path the
    model lacks, entries that are not embedding, (one module on the embeddings), blocks, one final norm and a head
    giving ``logits`` in that order, or a module of the base model the plan leaves out (other than its rotary
    embedding)."""
    plan = plan_of(model)
    if not isinstance(model, PreTrainedModel) or not getattr(model.config, "base_model_pp_plan", None):
        return "it declares no pipeline plan (config.base_model_pp_plan)"
    missing = [path for path in plan if not _has(model, path)]
    if missing:
        return f"its plan names {missing}, which {type(model).__name__} does not have"
    heads = [path for path, (_, outputs) in plan.items() if outputs == ["logits"]]
    lists = [path for path in plan if isinstance(model.get_submodule(path), nn.ModuleList)]
    if len(heads) != 1 or len(lists) != 1:
        return f"its plan names {len(heads)} modules giving logits and {len(lists)} lists of blocks, not one each"
    blocks, head = lists[0], heads[0]
    parent = blocks.rpartition(".")[0]
    base = [path for path in plan if path.rpartition(".")[0] == parent and path != head]
    where = base.index(blocks)
    before, after = base[:where], base[where + 1 :]
    if not 1 <= len(before) <= 2 or plan[before[0]][0] != ["input_ids"] or len(after) != 1:
        return (
            f"its plan {list(plan)} is not an embedding taking input_ids (and at most one module on it), the blocks,"
            " one final norm and the head"
        )
    base_model = model.get_submodule(parent) if parent else model
    altup = altup_children(cast(Any, model).config, base_model, blocks.rpartition(".")[2])
    left = {name: child for name, child in base_model.named_children() if f"{parent}.{name}".lstrip(".") not in plan}
    left = {name: child for name, child in left.items() if name not in (altup or ())}  # AltUp's, known
    kinds = {name: _left_out(model, base_model, name, child) for name, child in left.items() if name != ROTARY}
    unknown = [name for name, kind in kinds.items() if kind is None]
    outside = [name for name, _ in model.named_children() if name != head and name != parent.split(".")[0]]
    if unknown or outside:
        return (
            f"it holds {[*outside, *unknown]} besides the modules its plan names and those the adapter knows"
            f" (`{ROTARY}`, modules on (input_ids, inputs_embeds), rotary modules per layer_rope_theta, per-layer"
            " embeddings, a hyper-connection collapse, AltUp's widening and narrowing, modules without parameters or"
            " buffers)"
        )
    rotary = f"{parent}.{ROTARY}" if ROTARY in left else None
    extensions = tuple(f"{parent}.{name}".lstrip(".") for name, kind in kinds.items() if kind == "extension")
    rotaries = [f"{parent}.{name}".lstrip(".") for name, kind in kinds.items() if kind == "rotaries"]
    per_layer = tuple(f"{parent}.{name}".lstrip(".") for name, kind in kinds.items() if kind == "per layer")
    collapse = [f"{parent}.{name}".lstrip(".") for name, kind in kinds.items() if kind == "collapse"]
    if len(rotaries) > 1 or len(collapse) > 1:
        return f"it holds {[*rotaries, *collapse]} besides the modules its plan names: more than one of a kind"
    dropout = before[1] if len(before) > 1 else None
    return DecoderCut(
        before[0], dropout, blocks, rotary, after[0], head, extensions, next(iter(rotaries), None), per_layer,
        next(iter(collapse), None),
        altup=None if altup is None else cast(tuple[str, str], tuple(f"{parent}.{n}".lstrip(".") for n in altup)),
    )  # fmt: skip


def _left_out(model: nn.Module, base_model: nn.Module, name: str, child: nn.Module) -> str | None:
    """What a child of the base model the plan leaves out is to the cut: ``"extension"``, a module taking
    ``(input_ids, inputs_embeds)`` (applied on the embeddings, :class:`~lightning_gpipe.hf.decoder.DecoderEmbedding`:
    Phi-4-multimodal's image and audio features); ``"rotaries"``, an ``nn.ModuleList`` of modules of the class of the
    base model's rotary embedding where the config gives each layer its ``layer_rope_theta`` (Granite-SWA); ``"idle"``,
    a module without parameters or buffers (nothing to hold; the self-check proves the forward does not need it:
    Phi-4-multimodal's ``embed_dropout``, which its forward never calls); ``"per layer"``, a per-layer embedding
    module (:func:`~lightning_gpipe.hf.decoder_layout.per_layer_module`: Gemma 4's ``embed_tokens_per_layer``...),
    which computes the per-layer inputs at the embedding; ``"collapse"``, any other module of a model with
    hyper-connections (``config.hc_mult`` streams: HY-V4's ``hc_head``), applied before the final norm; else
    ``None``."""
    if not [*child.parameters(), *child.buffers()]:
        return "idle"
    if per_layer_module(base_model, name):
        return "per layer"
    if isinstance(getattr(cast(Any, model).config, "hc_mult", None), int):
        return "collapse"
    arguments = list(inspect.signature(child.forward).parameters)
    if arguments[:2] == ["input_ids", "inputs_embeds"]:
        return "extension"
    return "rotaries" if theta_rotaries(cast(Any, model).config, base_model, child) else None


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def declared_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is cut by its declared plan (:func:`declared_cut`), else why not: no plan or one the
    adapter cannot follow, layer types it does not rebuild, blocks taking what it does not give them.

    Raises:
        UnsupportedModelError: if the model is also of the standard layout (:func:`standard_decoder`) and the plan
            cuts it elsewhere: naming both cuts (the self-check cannot say which the model's forward follows before
            one is chosen).
    """
    cut = declared_cut(model)
    if isinstance(cut, str):
        return cut
    config = cast(Any, model).config
    blocks = cast(nn.ModuleList, model.get_submodule(cut.blocks))
    per_block = sublayers(config, len(blocks))
    if isinstance(per_block, str):
        return f"`{cut.blocks}` holds {len(blocks)} blocks: {per_block}"
    if bidirectional(config):
        return "use_bidirectional_attention=True (a bidirectional encoder, not a causal LM)"
    rotary = None if cut.rotary is None else model.get_submodule(cut.rotary)
    reason = (
        layer_types_reason(config, rotary) or kv_sharing_reason(config) or block_arguments_reason(blocks[0], config)
    )
    if reason is None and standard_decoder(model) is None:
        structural = standard_cut(cast(PreTrainedModel, model))
        if structural != cut:
            raise UnsupportedModelError(
                f"{type(model).__name__}'s declared pipeline plan and its structure disagree: the plan cuts it as"
                f" {cut.describe()}, the standard layout as {structural.describe()}. Pass the cut you mean as a"
                " Family (docs/transformers.md, 'Adding a family'); the self-check then proves it on the model's own"
                " forward."
            )
    return reason


def declared_decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model its declared plan cuts (:func:`~lightning_gpipe.hf.decoder_cut.decoder_layers` at
    :func:`declared_cut`)."""
    cut = declared_cut(model)
    assert not isinstance(cut, str)  # the family takes only models whose plan gives a cut
    return decoder_layers(model, cut)


def plan_source(model: nn.Module) -> str:
    """Where the declared plan's cut of ``model`` comes from, and what the structure says of it (for messages)."""
    cut = declared_cut(model)
    assert not isinstance(cut, str)  # asked of models the plan cuts
    structure = standard_decoder(model)
    verdict = "the same" if structure is None else f"none ({structure})"
    return f"cut where its declared pipeline plan says ({cut.describe()}; the cut by structure: {verdict})"


def structure_source(model: nn.Module) -> str:
    """Where the structural cut of ``model`` comes from, and why its declared plan (if any) was not followed."""
    cut = standard_cut(cast(PreTrainedModel, model))
    return f"cut by its structure ({cut.describe()}; not where a declared plan says: {declared_decoder(model)})"


# ------------------------------------------------------------------ families


@dataclass(frozen=True)
class Family:
    """How to cut one architecture into backbone layers.

    Attributes:
        name: a short name, for messages (``"gpt2"``).
        classes: the model class names it takes by name (``"GPT2LMHeadModel"``...); empty for a family that takes
            models by ``structure``.
        layers: builds the layers from a model it takes.
        inputs: what the backbone takes, for messages and docs (``"(input_ids, attention_mask, position_ids)"``).
        structure: for a family by structure, ``None`` when it takes a model, else why not (a sentence for the
            error message); ``None`` (default) for a family by name.
        encoder: whether the backbone takes an encoder's ``(input_ids, attention_mask, token_type_ids)`` (else a
            causal LM's ``(input_ids, attention_mask, position_ids)``, whose loss the self-check compares too).
            Default ``False``.
        seq2seq: whether the backbone is an encoder-decoder's, taking ``(input_ids, attention_mask,
            decoder_input_ids, decoder_attention_mask)`` (:mod:`lightning_gpipe.hf.seq2seq`). Default ``False``.
        source: where the cut of a model it takes comes from, a phrase for the self-check's messages (the decoder
            families: the declared plan or the structure, and what the other says); ``None`` (default): the
            family's name.
    """

    name: str
    classes: tuple[str, ...]
    layers: Callable[[PreTrainedModel], list[nn.Module]]
    inputs: str
    structure: Callable[[nn.Module], str | None] | None = None
    encoder: bool = False
    source: Callable[[nn.Module], str] | None = None
    seq2seq: bool = False

    def describe(self, model: nn.Module) -> str:
        """Where the cut of ``model`` (a model this family takes) comes from: :attr:`source`'s phrase, else "cut by
        the <name> family"."""
        return self.source(model) if self.source is not None else f"cut by the {self.name} family"


DECODER_INPUTS = "(input_ids, attention_mask, position_ids)"
"""What a decoder's backbone takes (:attr:`Family.inputs`; see :func:`~lightning_gpipe.hf.packing.decoder_input`)."""

ENCODER_INPUTS = "(input_ids, attention_mask, token_type_ids)"
"""What an encoder's backbone takes (:attr:`Family.inputs`; see :func:`~lightning_gpipe.hf.encoder.encoder_input`)."""

FAMILIES: list[Family] = [
    Family("gpt2", ("GPT2LMHeadModel",), gpt2_layers, DECODER_INPUTS),
    Family(
        "declared plan",
        (),
        declared_decoder_layers,
        DECODER_INPUTS,
        structure=declared_decoder,
        source=plan_source,
    ),
    Family("decoder", (), standard_decoder_layers, DECODER_INPUTS, structure=standard_decoder, source=structure_source),
    Family("gpt2-like", (), gpt2_like_layers, DECODER_INPUTS, structure=gpt2_like_decoder),
    Family("decoder stack", (), decoder_stack_layers, DECODER_INPUTS, structure=decoder_stack),
    Family("composite", (), composite_layers, DECODER_INPUTS, structure=composite_decoder),
    Family("causal encoder", (), causal_encoder_layers, DECODER_INPUTS, structure=causal_encoder),
    Family("encoder", (), standard_encoder_layers, ENCODER_INPUTS, structure=standard_encoder, encoder=True),
    Family("encoder-decoder", (), encoder_decoder_layers, SEQ2SEQ_INPUTS, structure=encoder_decoder, seq2seq=True),
]
"""The registered families, tried in order by :func:`family_of`: GPT-2 by name; then a decoder cut where its
declared pipeline plan says (:func:`declared_decoder`: ``config.base_model_pp_plan``, the
first source); then by structure, the standard decoder layout
(:func:`~lightning_gpipe.hf.decoder_layout.standard_decoder`, the fallback), the GPT-2-like decoders without a plan
(:func:`~lightning_gpipe.hf.gpt2_like.gpt2_like_decoder`: Bloom, Falcon, MPT, GPT-BigCode, XGLM, Mamba, Jamba...), the
causal LMs of one decoder stack (:func:`~lightning_gpipe.hf.decoder_stack.decoder_stack`: OPT, BioGPT, BART's...),
composite models cut as their language model is (:func:`~lightning_gpipe.hf.composite.composite_decoder`: Gemma 3's
image-text model, Voxtral, Qwen2-Audio...), the BERT-style causal-LM heads with ``is_decoder=True``
(:func:`~lightning_gpipe.hf.causal_encoder.causal_encoder`: BERT, RoBERTa, ELECTRA, RoFormer...), the BERT-style
encoders
(:func:`~lightning_gpipe.hf.encoder.standard_encoder`) and the encoder-decoders
(:func:`~lightning_gpipe.hf.seq2seq.encoder_decoder`: T5, BART, Marian, M2M100...)."""


def register_family(family: Family) -> None:
    """Add ``family`` to :data:`FAMILIES` (first, so it wins over a built-in family taking the same class)."""
    FAMILIES.insert(0, family)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` that takes ``model``: the first of :data:`FAMILIES` that names its class or takes its
    structure.

    Raises:
        UnsupportedModelError: if none takes it; the message names the class and why each family by structure
            does not take it.
    """
    name = type(model).__name__
    reasons = []
    for family in FAMILIES:
        if name in family.classes:
            return family
        if family.structure is not None:
            reason = family.structure(model)
            if reason is None:
                return family
            reasons.append(f"not the {family.name} layout: {reason}")
    named = ", ".join(c for family in FAMILIES for c in family.classes)
    raise UnsupportedModelError(
        f"lightning_gpipe.hf cannot pipeline {name}: {'; '.join(reasons)}; and no registered family names it"
        f" ({named}). A model of another layout needs a Family that cuts it into tensor-only layers: see"
        " docs/transformers.md, 'Adding a family'."
    )


def check_class(model_class: type, config: Any) -> Family:
    """The self-check of ``model_class`` with ``config`` (:func:`lightning_gpipe.hf.selfcheck.verify`), before any
    model of it is built: the LightningModules call it in ``__init__``, so a class cut wrongly stops the script
    before any stage process starts.

    Returns:
        The :class:`Family` that cuts the class.

    Raises:
        SelfCheckError: naming the class and the first backbone layer that differs from its own forward.
        UnsupportedModelError: if no family takes the class.
    """
    return selfcheck.verify(model_class, config, family_of)


def to_sequential(model: nn.Module, weights: Any | None = None, check: bool = True) -> nn.Sequential:
    """The backbone of ``model``: embeddings -> one layer per block -> final norm -> head, sharing its modules.

    Nothing is copied: the layers hold ``model``'s modules (under their names in ``model``, see :class:`HFLayer`),
    so training the backbone trains ``model``, ``model.save_pretrained`` saves it, and ``model``'s tied parameters
    are one ``nn.Parameter`` in two layers. Call it on a model built on the meta device to let each stage allocate
    only its own layers (they initialise, or load from ``weights``, in :meth:`HFLayer.reset_parameters`). A
    ``peft`` model is cut as the model inside it, whose LoRA layers hold the frozen weights and the adapters.

    Decoders take ``(input_ids, attention_mask, position_ids)``, encoders ``(input_ids, attention_mask,
    token_type_ids)``, each ``(N, S)`` long (the mask 1 for real tokens, 0 for padding; see
    :func:`~lightning_gpipe.hf.packing.decoder_input`), and return the logits ``(N, S, V)`` (``(N, num_labels)``
    for sequence classification); a mixture of experts with ``output_router_logits=True`` returns ``(logits,
    router statistics)`` (:mod:`lightning_gpipe.hf.moe`); encoder-decoders take ``(input_ids, attention_mask,
    decoder_input_ids, decoder_attention_mask)`` and return the logits ``(N, T, V)``
    (:func:`~lightning_gpipe.hf.seq2seq.seq2seq_input`). Applied layer by layer on one device it equals ``model``'s
    own forward.

    Args:
        model: a ``transformers`` model (or a ``peft`` model of one) that a :class:`Family` takes, in training or
            eval mode.
        weights: where the layers read their tensors when materialised (meta-device builds), see
            :attr:`HFLayer.weights`, or ``None`` (default) to initialise new weights as the model does.
        check: run the self-check on ``model``'s class and config first (default). ``False`` skips it: for a class
            already checked with this config (:func:`check_class`), or one you have verified yourself.

    Returns:
        The ``nn.Sequential`` of :class:`HFLayer` layers, in ``model``'s mode (training or eval).

    Raises:
        UnsupportedModelError: for a model no family takes, naming it and why (before any step runs).
        SelfCheckError: if the class's miniature cut into layers differs from its own forward, naming the layer.
        ValueError: if the layers leave a parameter or buffer of ``model`` out (a family that misses a module).
    """
    inner, extra_init = lora.unwrap(model)
    family = family_of(inner)
    if check:
        check_class(type(inner), inner.config)
    layers = family.layers(cast(PreTrainedModel, inner))  # a model a family takes: a transformers model
    held = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    unsaved = unsaved_buffers(inner)  # held by the base model itself, which no layer holds, and never read
    missing = [
        n for n, t in [*inner.named_parameters(), *inner.named_buffers()] if id(t) not in held and n not in unsaved
    ]
    if missing:
        raise ValueError(
            f"The {family.name} family's layers leave {len(missing)} tensors of {type(inner).__name__} out"
            f" ({', '.join(missing[:3])}...): its layers must hold every module with parameters or buffers."
        )
    for layer in layers:
        if isinstance(layer, HFLayer):
            layer.weights = weights
            layer.extra_init = extra_init
    return nn.Sequential(*layers).train(inner.training)  # in the model's mode: a dropout a layer applies itself too
