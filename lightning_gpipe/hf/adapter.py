"""A loaded Hugging Face ``transformers`` model as the backbone contract: one ``nn.Sequential`` of tensor-only layers.

:func:`to_sequential` returns embeddings -> one layer per decoder (or encoder) block -> final norm -> head. The
layers hold the model's own modules (no weight is copied): each layer holds its modules under their paths in the
model, so a layer's state-dict names are the model's (``backbone.3.model.layers.2.mlp.up_proj.weight`` is
``model.layers.2.mlp.up_proj.weight`` of the model, behind the layer's ``backbone.3.`` prefix), and a parameter the
model ties (input embedding and output projection) is one ``nn.Parameter`` in two layers, which the strategy's tie
mechanism (:mod:`lightning_gpipe.engine.ties`) finds by itself.

Which layers a model is cut into is its :class:`Family`'s business. Models are recognised by their structure, not
their class name: the standard decoder layout of ``transformers`` 5 (:mod:`lightning_gpipe.hf.decoder`) and the
BERT-style encoders (:mod:`lightning_gpipe.hf.encoder`); GPT-2 is a family by name, and :func:`register_family` adds
more. Before a class is cut for the first time in a process, the self-check (:mod:`lightning_gpipe.hf.selfcheck`)
proves its cut on a miniature built from the same config, so a class that looks standard and is not is refused
rather than trained wrongly. A ``peft`` model is cut as the model inside it (:mod:`lightning_gpipe.hf.lora`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from lightning_gpipe.hf import lora, selfcheck
from lightning_gpipe.hf.decoder import gpt2_layers, standard_decoder, standard_decoder_layers
from lightning_gpipe.hf.encoder import standard_encoder, standard_encoder_layers
from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel, UnsupportedModelError


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
    """

    name: str
    classes: tuple[str, ...]
    layers: Callable[[PreTrainedModel], list[nn.Module]]
    inputs: str
    structure: Callable[[nn.Module], str | None] | None = None
    encoder: bool = False


DECODER_INPUTS = "(input_ids, attention_mask, position_ids)"
"""What a decoder's backbone takes (:attr:`Family.inputs`; see :func:`~lightning_gpipe.hf.decoder.decoder_input`)."""

ENCODER_INPUTS = "(input_ids, attention_mask, token_type_ids)"
"""What an encoder's backbone takes (:attr:`Family.inputs`; see :func:`~lightning_gpipe.hf.encoder.encoder_input`)."""

FAMILIES: list[Family] = [
    Family("gpt2", ("GPT2LMHeadModel",), gpt2_layers, DECODER_INPUTS),
    Family("decoder", (), standard_decoder_layers, DECODER_INPUTS, structure=standard_decoder),
    Family("encoder", (), standard_encoder_layers, ENCODER_INPUTS, structure=standard_encoder, encoder=True),
]
"""The registered families, tried in order by :func:`family_of`: GPT-2 by name, then the standard decoder layout
(:func:`~lightning_gpipe.hf.decoder.standard_decoder`) and the BERT-style encoders
(:func:`~lightning_gpipe.hf.encoder.standard_encoder`) by structure."""


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
    :func:`~lightning_gpipe.hf.decoder.decoder_input`), and return the logits ``(N, S, V)`` (``(N, num_labels)``
    for sequence classification); a mixture of experts with ``output_router_logits=True`` returns ``(logits,
    router statistics)`` (:mod:`lightning_gpipe.hf.moe`). Applied layer by layer on one device it equals
    ``model``'s own forward.

    Args:
        model: a ``transformers`` model (or a ``peft`` model of one) that a :class:`Family` takes, in training or
            eval mode.
        weights: where the layers read their tensors when materialised (meta-device builds), see
            :attr:`HFLayer.weights`, or ``None`` (default) to initialise new weights as the model does.
        check: run the self-check on ``model``'s class and config first (default). ``False`` skips it: for a class
            already checked with this config (:func:`check_class`), or one you have verified yourself.

    Returns:
        The ``nn.Sequential`` of :class:`HFLayer` layers.

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
    missing = [n for n, t in [*inner.named_parameters(), *inner.named_buffers()] if id(t) not in held]
    if missing:
        raise ValueError(
            f"The {family.name} family's layers leave {len(missing)} tensors of {type(inner).__name__} out"
            f" ({', '.join(missing[:3])}...): its layers must hold every module with parameters or buffers."
        )
    for layer in layers:
        if isinstance(layer, HFLayer):
            layer.weights = weights
            layer.extra_init = extra_init
    return nn.Sequential(*layers)
