"""Where a decoder is cut, and its backbone layers at that cut: embeddings, one layer per block, final norm, head.

:class:`DecoderCut` names the modules each layer holds: the declared plan's (:mod:`lightning_gpipe.hf.adapter`), or
:func:`standard_cut` for the standard layout (:mod:`lightning_gpipe.hf.decoder_layout`). :func:`decoder_layers` cuts
there, with the deviations the config declares: a multiplier on the embeddings (Granite's ``embedding_multiplier``) or
a dropout on them (StarCoder 2's ``embedding_dropout``), the hidden states scaled before the head (MiniCPM3's
``dim_model_base``), logits scaled (``logits_scaling``, ``logit_scale``) or soft-capped (``final_logit_softcapping``),
a rotary module per layer theta (Granite-SWA), blocks of several attention layers (LongCat-Flash), blocks the forward
skips on text (Mllama's cross-attention layers, :class:`~lightning_gpipe.hf.decoder.SkippedBlock`), and
mixture-of-experts routers whose load-balancing loss travels as per-row statistics (:mod:`lightning_gpipe.hf.moe`).
:func:`gpt2_layers` cuts GPT-2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from lightning_gpipe.hf.decoder import DecoderEmbedding, FinalNorm, GPT2Block, Head, RotaryDecoderBlock, SkippedBlock
from lightning_gpipe.hf.decoder_layout import (
    base_name,
    collapse_name,
    hyper_streams,
    norm_before_blocks,
    skipped_block,
    theta_rotaries_name,
)
from lightning_gpipe.hf.layer import PreTrainedModel
from lightning_gpipe.hf.masks import layer_type
from lightning_gpipe.hf.moe import router_loss_of


def head_scaling(config: Any) -> tuple[float | None, dict[str, Any]]:
    """How the model's forward scales its output, as its config declares it: ``(divisor of the final norm's output,
    the :class:`~lightning_gpipe.hf.decoder.Head`'s keyword arguments)``.

    MiniCPM3 (``dim_model_base``) divides the hidden states by ``logits_scaling = hidden_size / dim_model_base``
    before the head, Inkling by ``logits_mup_width_multiplier``; Granite divides the logits by ``logits_scaling``,
    Cohere multiplies them by ``logit_scale`` (Falcon-H1 by ``lm_head_multiplier``), Gemma 2 and 3 soft-cap them
    (``final_logit_softcapping``; xLSTM by ``output_logit_soft_cap``); Inkling keeps the first
    ``unpadded_vocab_size``.
    """
    hidden_divisor = getattr(config, "logits_mup_width_multiplier", None)
    if getattr(config, "dim_model_base", None) is not None:
        hidden_divisor = config.logits_scaling
    vocab = getattr(config, "unpadded_vocab_size", None)
    head = {
        "multiplier": getattr(config, "logit_scale", None) or getattr(config, "lm_head_multiplier", None),
        "divisor": None if hidden_divisor is not None else getattr(config, "logits_scaling", None),
        "softcap": getattr(config, "final_logit_softcapping", None)
        or getattr(config, "output_logit_soft_cap", None)
        or getattr(config, "logits_soft_cap", None),
        "vocab": vocab if vocab is not None and vocab < config.vocab_size else None,
    }
    return hidden_divisor, head


def own_field(config: Any, name: str) -> Any:
    """``config``'s field ``name``, or ``None`` where it has none or ``name`` is an alias of another field
    (``attribute_map``: Inkling's ``embedding_multiplier`` reads its ``logits_mup_width_multiplier``, which its
    forward applies before the head, not to the embeddings)."""
    if name in getattr(config, "attribute_map", {}):
        return None
    return getattr(config, name, None)


@dataclass(frozen=True)
class DecoderCut:
    """Where a decoder is cut: the paths in the model of the modules each backbone layer holds.

    Attributes:
        embedding: the token embedding (``"model.embed_tokens"``, GPT-NeoX's ``"gpt_neox.embed_in"``).
        dropout: a module applied to the embeddings before the blocks (Phi's ``"model.embed_dropout"``), or ``None``.
        blocks: the ``nn.ModuleList`` of blocks (``"model.layers"``).
        rotary: the rotary embedding every block's layer holds (``"model.rotary_emb"``), or ``None``.
        norm: the final norm (``"model.norm"``, Phi's ``"model.final_layernorm"``), or ``None`` where the collapse
            of hyper-connection streams ends the blocks' output alone (Qwen4-Exp's).
        head: the output head (``"lm_head"``).
        extensions: modules applied to ``(input_ids, embeddings)`` after the embedding (Phi-4-multimodal's
            ``"model.embed_tokens_extend"``, see :class:`~lightning_gpipe.hf.decoder.DecoderEmbedding`); default none.
        rotaries: an ``nn.ModuleList`` of rotary embeddings, one per ``rope_theta`` of the config's per-layer
            ``layer_rope_theta`` (Granite-SWA's ``"model.rotary_embs"``; a theta of 0: no rotary), which the
            blocks call instead of ``rotary`` (see :func:`block_rotary`); default ``None``.
        per_layer: the base model's per-layer embedding modules (Gemma 4's ``"model.embed_tokens_per_layer"``,
            ``"model.per_layer_model_projection"``, ``"model.per_layer_projection_norm"``), held by the embedding
            layer, which computes the per-layer inputs with the base model's own methods (see
            :class:`~lightning_gpipe.hf.decoder.DecoderEmbedding`); default none.
        collapse: with hyper-connections (streams of hidden states, which the embedding layer makes as the model's
            forward does: :func:`~lightning_gpipe.hf.decoder_layout.hyper_streams`), the module that collapses them
            before the final norm (HY-V4's ``"model.hc_head"``; Qwen4-Exp's ``"model.hyper_connection_mixer"``,
            without a norm); default ``None``.
        held: modules the embedding layer holds and text does not run through: a composite model's other towers
            (Gemma 3's ``"model.vision_tower"``, ``"model.multi_modal_projector"``, see
            :mod:`lightning_gpipe.hf.composite`); default none.
        altup: ``(widening, narrowing)``: the modules that widen the embeddings into AltUp's stack of predictions,
            which the blocks take, and narrow it before the final norm (Gemma 3n's ``"model.altup_projections"``,
            ``"model.altup_unembed_projections"``, :mod:`lightning_gpipe.hf.altup`); default ``None``.
    """

    embedding: str
    dropout: str | None
    blocks: str
    rotary: str | None
    norm: str | None
    head: str
    extensions: tuple[str, ...] = ()
    rotaries: str | None = None
    per_layer: tuple[str, ...] = ()
    collapse: str | None = None
    held: tuple[str, ...] = ()
    altup: tuple[str, str] | None = None

    def describe(self) -> str:
        """The cut as a line: ``"model.embed_tokens -> model.layers.* -> model.norm -> lm_head"``."""
        embedding = f"{self.embedding} (holding {', '.join(self.held)})" if self.held else self.embedding
        widen, narrow = self.altup or (None, None)
        first = [embedding, *self.extensions, *([self.dropout] if self.dropout else []), *([widen] if widen else [])]
        last = [path for path in (self.collapse, narrow, self.norm, self.head) if path]
        return " -> ".join([*first, f"{self.blocks}.*", *last])


def sublayers(config: Any, blocks: int) -> int | str:
    """How many attention layers each of ``blocks`` blocks holds (``num_hidden_layers`` counts attention layers:
    LongCat-Flash's blocks hold two), or why that is not a whole number of layers of one type per block."""
    count = config.num_hidden_layers
    if blocks == 0 or count % blocks:
        return f"its {blocks} blocks do not divide num_hidden_layers ({count}) into whole attention layers"
    per_block = count // blocks
    mixed = [i for i in range(blocks) if len({layer_type(config, i * per_block + j) for j in range(per_block)}) > 1]
    if mixed:
        return f"block {mixed[0]} holds attention layers of several types (config.layer_types)"
    return per_block


def block_rotary(model: nn.Module, cut: DecoderCut, index: int) -> tuple[str | None, tuple[str, ...]]:
    """``(the rotary embedding block ``index``'s layer calls, or None; the rotary modules it holds uncalled)``: the
    cut's ``rotary``; with per-layer thetas (:attr:`DecoderCut.rotaries`), the one of ``config.layer_rope_theta
    [index]`` (none for 0), holding the model's global one, which its forward leaves unused."""
    if cut.rotaries is None:
        return cut.rotary, ()
    theta = cast(Any, model).config.layer_rope_theta[index]
    rotaries = cast(nn.ModuleList, model.get_submodule(cut.rotaries))
    own = [i for i, r in enumerate(rotaries) if cast(Any, r).config.rope_parameters["rope_theta"] == theta]
    called = f"{cut.rotaries}.{own[0]}" if theta else None
    return called, tuple(path for path in (cut.rotary,) if path is not None)


def standard_cut(model: PreTrainedModel) -> DecoderCut:
    """The cut of a model of the standard decoder layout
    (:func:`~lightning_gpipe.hf.decoder_layout.standard_decoder`); its final norm applied on the embeddings too where
    its forward applies it before the blocks (:func:`~lightning_gpipe.hf.decoder_layout.norm_before_blocks`:
    NanoChat's); the module collapsing hyper-connection streams where it has one
    (:func:`~lightning_gpipe.hf.decoder_layout.collapse_name`: Qwen4-Exp's, without a norm)."""
    prefix = base_name(model)
    base = model.get_submodule(prefix)
    norm = f"{prefix}.norm" if hasattr(base, "norm") else None  # none where a collapse ends the blocks (Qwen4-Exp)
    on_embeddings = norm if norm_before_blocks(base) else None  # NanoChat's norm, twice
    rotaries, collapse = theta_rotaries_name(model), collapse_name(base)
    return DecoderCut(
        f"{prefix}.embed_tokens", on_embeddings, f"{prefix}.layers", f"{prefix}.rotary_emb", norm, "lm_head",
        rotaries=None if rotaries is None else f"{prefix}.{rotaries}",
        collapse=None if collapse is None else f"{prefix}.{collapse}",
    )  # fmt: skip


def decoder_layers(model: PreTrainedModel, cut: DecoderCut) -> list[nn.Module]:
    """The backbone layers of a decoder cut at ``cut``: embeddings, one layer per block, final norm, head, with the
    deviations its config declares (see the module docstring).

    Raises:
        UnsupportedModelError: if the model adds a load-balancing loss the adapter cannot carry
            (:func:`~lightning_gpipe.hf.moe.router_loss_of`).
    """
    config = model.config
    router = router_loss_of(model)
    hidden_divisor, head = head_scaling(config)
    modules = cast(nn.ModuleList, model.get_submodule(cut.blocks))
    base = model.get_submodule(cut.blocks.rpartition(".")[0])
    per_block = sublayers(config, len(modules))
    assert isinstance(per_block, int)  # the families take only models whose blocks hold whole layers
    blocks: list[RotaryDecoderBlock | SkippedBlock] = []
    for i, module in enumerate(modules):
        rotary, held = block_rotary(model, cut, i)
        path = f"{cut.blocks}.{i}"
        skipped = skipped_block(base, module)  # Mllama's cross-attention layers on text
        blocks.append(
            SkippedBlock(model, path)
            if skipped
            else RotaryDecoderBlock(model, path, rotary, i * per_block, router, held, cut.altup is not None)
        )
    return [
        DecoderEmbedding(
            model,
            cut.embedding,
            dropout=cut.dropout,
            multiplier=own_field(config, "embedding_multiplier"),
            dropout_p=own_field(config, "embedding_dropout"),
            router=router,
            extensions=cut.extensions,
            per_layer=(cut.blocks.rpartition(".")[0], cut.per_layer) if cut.per_layer else None,
            streams=hyper_streams(base) if cut.collapse else None,
            pass_tokens=any(block.tokens for block in blocks),
            held=cut.held,
            altup=cut.altup[0] if cut.altup else None,
        ),
        *blocks,
        FinalNorm(model, cut.norm, router, hidden_divisor, cut.collapse, cut.altup[1] if cut.altup else None),
        Head(model, cut.head, **head),
    ]


def standard_decoder_layers(model: PreTrainedModel) -> list[nn.Module]:
    """The backbone layers of a model of the standard decoder layout (:func:`decoder_layers` at
    :func:`standard_cut`)."""
    return decoder_layers(model, standard_cut(model))


def gpt2_layers(model: PreTrainedModel) -> list[nn.Module]:
    """GPT-2's backbone layers: token and position embeddings, one layer per block, ``ln_f``, ``lm_head``."""
    return [
        DecoderEmbedding(model, "transformer.wte", "transformer.wpe", "transformer.drop"),
        *(GPT2Block(model, f"transformer.h.{i}") for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, "transformer.ln_f"),
        Head(model, "lm_head"),
    ]
