"""The adapter's proof on the user's class, before the first step: a miniature cut layer by layer equals its forward.

The adapter cuts a model by its structure (:mod:`lightning_gpipe.hf.decoder_layout`, :mod:`lightning_gpipe.hf.encoder`),
so a class that looks standard but computes something else in its ``forward`` (a scale on the logits, another mask, a
dropout elsewhere) would train a different model without a word. :func:`verify` rules that out: it builds a miniature of
the user's class from the user's config (:func:`miniature_config`: two layers, or one per kind of layer the config
lists, widths of 64, a 128-token vocabulary, sliding windows of 4, every other option as given), in fp32 on the CPU with
every parameter drawn at random (so that every path counts), and runs a probe batch of 3 rows of 10 tokens (one
left-padded, one right-padded) through the model's own ``forward`` and through the cut backbone layer by layer,
comparing what each backbone layer passes on with what the model's next module received (forward pre-hooks), and the
logits, on the real tokens, to 1e-5:

- in evaluation mode;
- in training mode, with the config's dropout probabilities and the same seed on both sides (a dropout applied
  elsewhere, or not at all, draws other numbers);
- for causal LMs, the loss with labels (:func:`~lightning_gpipe.hf.decoder.causal_lm_loss`: mixture-of-experts
  load-balancing loss included).

The first difference raises :class:`SelfCheckError` naming the class and the backbone layer. A check costs a few
hundredths of a second (docs/transformers.md).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.altup import from_block
from lightning_gpipe.hf.composite import TEXT_CONFIG, text_config
from lightning_gpipe.hf.decoder import SkippedBlock, causal_lm_loss, shifts_labels
from lightning_gpipe.hf.encoder import encoder_input
from lightning_gpipe.hf.layer import HFLayer, UnsupportedModelError
from lightning_gpipe.hf.masks import HYBRID, layer_type
from lightning_gpipe.hf.moe import router_loss_of
from lightning_gpipe.hf.packing import decoder_input
from lightning_gpipe.hf.seq2seq import StackBlock, StackEmbedding, seq2seq_input, seq2seq_loss
from lightning_gpipe.hf.seq2seq_inputs import encoder_output

SIZES = {
    "hidden_size": 64,
    "vocab_size": 128,
    "num_attention_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 128,
}
"""The miniature's widths, each set where the config has an integer of that name: hidden size, vocabulary,
attention heads and their width (multi-head latent attention's ranks and widths too, its ``head_dim`` following
``qk_rope_head_dim``), feed-forward widths, per-layer embeddings (Gemma 4's)."""

LIMITS = {
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "rotary_dim": 8,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
}
"""The miniature's upper bounds, each applied where the config has an integer of that name (key/value heads equal to
the attention heads stay equal; experts are kept when the config groups them, ``n_group``; CodeGen's and GPT-J's
rotary width within a head's; one dense layer before the mixtures of experts, DeepSeek's ``first_k_dense_replace``,
LFM2-MoE's ``num_dense_layers``, so that the miniature's second layer is a mixture's)."""

SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"))
"""The heads of a state-space mixer, ``(heads, head width, expansion)`` (Mamba-2's; Bamba's ``mamba_...``): the mixer
is ``expansion * hidden_size`` wide, ``heads`` times the head width, so the miniature gives it as many heads as its
width holds (at least one)."""

SSM_WIDTH = "mamba_d_ssm"
"""A state-space mixer's width where the config gives it outright (Falcon-H1's; else ``expansion * hidden_size``): the
miniature's is its heads times their width (:data:`SSM_HEADS`)."""

SEQ2SEQ_LIMITS = {
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "d_ff": 128,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "d_kv": 16,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
}
"""An encoder-decoder miniature's upper bounds besides (``is_encoder_decoder`` configs): the decoder's depth (the
encoder's is ``num_hidden_layers``), feed-forward widths, T5's head width and the heads of each stack; a target
vocabulary (Marian's ``decoder_vocab_size``) is the miniature's vocabulary."""

ROWS, LENGTH, TOLERANCE = 3, 10, 1e-5
"""The probe batch's rows and tokens, and the largest difference allowed."""


class SelfCheckError(UnsupportedModelError):
    """A model class whose miniature, cut into backbone layers, does not equal its own forward (or could not be
    checked); the message names the class and the first backbone layer that differs."""


class _Failed(Exception):
    """An error while checking: of the model's own side (building the miniature, its forward), which ``check=False``
    steps around, or of the cut (``where``: a backbone layer), which the real model's cut would meet too."""

    def __init__(self, error: Exception, where: str | None = None) -> None:
        super().__init__(error)
        self.error, self.where = error, where


def _layer_output(index: int, layer: Any, value: Any) -> Any:
    """``layer(value)``, backbone layer ``index``'s output; a failure raised as :class:`_Failed` naming the layer."""
    try:
        return layer(value)
    except Exception as error:
        raise _Failed(error, f"backbone layer {index} ({', '.join(layer.paths)})") from error


def _layer_indices(config: Any) -> dict[str, list[int]]:
    """The config's lists of layer indices, by name: a non-empty ``..._layers`` list of indices below
    ``num_hidden_layers``, not one entry per layer (Mllama's ``cross_attention_layers``, FLINT's
    ``mlp_only_layers``)."""
    count = config.num_hidden_layers
    return {
        name: list(value)
        for name, value in vars(config).items()
        if name.endswith("_layers") and isinstance(value, (list, tuple)) and value and len(value) != count
        and all(_is_integer(index) and 0 <= index < count for index in value)
    }  # fmt: skip


def _kept_layers(config: Any) -> list[int]:
    """The blocks the miniature keeps: the first block of each kind the config's per-layer lists (``layer_types``...),
    lists of layer indices (:func:`_layer_indices`: whether a block is among them), per-layer overrides
    (:func:`_overrides`) and key/value sharing (:func:`_first_kv_shared`) tell apart (the first two of a kind sharing
    a block, :func:`_shared_kinds`), then the next ones up to two."""
    count = config.num_hidden_layers
    lists = [v for v in vars(config).values() if isinstance(v, (list, tuple)) and len(v) == count]
    lists += [[index in indices for index in range(count)] for indices in _layer_indices(config).values()]
    overrides = _overrides(config) or {}
    sharing = _first_kv_shared(config)
    twice = _shared_kinds(config)
    first: dict[tuple, list[int]] = {}
    for index in range(count):
        kind = (*(repr(values[index]) for values in lists), repr(sorted(overrides.get(index, {}).items())))
        of_kind = first.setdefault((*kind, index >= sharing), [])
        if len(of_kind) < (2 if twice and layer_type(config, index) in twice else 1):
            of_kind.append(index)
    kept = sorted(index for indices in first.values() for index in indices)
    for index in range(count):
        if len(kept) >= min(2, count):
            break
        if index not in kept:
            kept = sorted([*kept, index])
    return kept


def _shared_kinds(config: Any) -> set[str]:
    """The layer types of ``config`` of which the miniature keeps two blocks: a hybrid type (attention beside a
    recurrent mixer, :data:`~lightning_gpipe.hf.masks.HYBRID`) in a config that also has layers of its recurrent type
    alone, the hybrid layers adding an attention block to a recurrent layer, one block the model shares across them
    (Zamba's and Zamba2's shared transformer, which ``transformers`` ties from the first hybrid layer into the others
    and cannot build with one): two of them prove what they share."""
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        return set()
    return {kind for kind in types if kind in HYBRID and HYBRID[kind][1] in types}


def _first_kv_shared(config: Any) -> int:
    """The first layer that reuses an earlier layer's keys and values (Gemma 3n's last ``num_kv_shared_layers``), or
    the depth where none does."""
    shared = getattr(config, "num_kv_shared_layers", 0)
    return config.num_hidden_layers - (shared if _is_integer(shared) else 0)


def _overrides(config: Any) -> dict[int, dict[str, Any]] | None:
    """A heterogeneous config's per-layer overrides (``transformers``' ``per_layer_config``: Dots3-Note's sliding
    layers with other widths), ``{layer: {name: value}}`` with every per-layer name, or ``None``."""
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is None:
        return None
    names = spec.explicit_per_layer_attributes
    # each layer's config (a copy without the per-layer overrides) reads them without a warning
    return {i: {n: getattr(config.per_layer_config[i], n) for n in names} for i in range(config.num_hidden_layers)}


def miniature_config(config: Any) -> Any:
    """A copy of ``config`` for the miniature: the blocks :func:`_kept_layers` keeps (per-layer lists and a
    heterogeneous config's per-layer overrides cut alike, lists of layer indices renumbered; as many layers reusing
    earlier keys and values as it keeps), the widths of :data:`SIZES` and the bounds of :data:`LIMITS` (per layer too,
    :func:`_shrunk`; an encoder-decoder's :data:`SEQ2SEQ_LIMITS` too), token ids within the vocabulary, no cache;
    what the config's class derives from them derived again (:func:`_derive_again`); every other option (dropout
    probabilities included) as given.

    A composite config (no depth of its own, a language model's ``text_config`` beside its towers': Gemma 3's,
    Voxtral's) is copied with its text config shrunk so and each tower cut to one block (:func:`_one_block_towers`),
    its own token ids as given (an image or audio placeholder id beyond the miniature's vocabulary is in no probe).
    T5Gemma's, whose stacks have configs of their own, is rebuilt from their miniatures (:func:`_joined_miniature`).

    Raises:
        UnsupportedModelError: for a config of several towers without a depth of its own or a text config that has
            one (:func:`_language_config`).
    """
    if _joined_stacks(config):
        return _joined_miniature(config)
    text = _language_config(config)
    if text is not None:
        mini = copy.deepcopy(config)
        setattr(mini, text, miniature_config(getattr(config, text)))
        _one_block_towers(mini, keep=text)
        mini.use_cache = False
        return mini
    mini = copy.deepcopy(config)
    overrides = _overrides(config)
    if overrides is not None:
        mini.per_layer_config = None  # the global values; the kept layers' own are set again below
    kept = _kept_layers(config)
    _cut_per_layer(config, mini, kept)
    if _integer(config, "num_kv_shared_layers"):  # as many sharing layers as kept: each kind's producer kept too
        mini.num_kv_shared_layers = sum(index >= _first_kv_shared(config) for index in kept)
    try:
        mini.num_hidden_layers = len(kept)
    except NotImplementedError:  # ProphetNet's config names its encoder's depth only
        mini.num_encoder_layers = len(kept)
    grouped = _integer(mini, "n_group")
    shrunk = {"num_hidden_layers": len(kept), **_shrunk(lambda name: getattr(mini, name, None), grouped)}
    for name, size in shrunk.items():
        if name != "num_hidden_layers" and not _derived(mini, name):
            setattr(mini, name, size)
    for mirror, name in _mirrors(config, shrunk).items():
        setattr(mini, mirror, shrunk[name])
    if overrides is not None:
        originals = {name: vars(config).get(name) for name in overrides[0]}
        layers = [_shrunk({**originals, **overrides[i]}.get, grouped) for i in kept]
        names = set(overrides[0])
        mini.per_layer_config = {j: {n: v for n, v in values.items() if n in names} for j, values in enumerate(layers)}
    if getattr(config, "is_encoder_decoder", False):
        _seq2seq_limits(mini)
    _one_block_towers(mini)
    _part_widths(config, mini)
    _derive_again(config, mini)
    mini.use_cache = False
    return mini


def _fields(config: Any) -> dict[str, Any]:
    """``config``'s fields (those its class declares) as its ``to_dict`` gives them."""
    fields = getattr(type(config), "__dataclass_fields__", {})
    return {name: value for name, value in config.to_dict().items() if name in fields}


def _derive_again(config: Any, mini: Any) -> None:
    """Give ``mini`` again the integers (and lists of them) its class derives from its other fields, where the
    shrinking left ``config``'s: attributes its initialisation sets that are no fields (Zamba2's
    ``attention_hidden_size``, ``mamba_headdim``, ``hybrid_layer_ids``) and fields it fills when left at their default
    (Zamba's ``attention_hidden_size``, ``None``: twice the hidden size; ``mamba_dt_rank``, ``"auto"``). Found by
    building the class again from ``config``'s fields with those at their defaults (a value it gives back alike was
    derived, not given) and from ``mini``'s; a config its class cannot build so keeps its values."""
    fields = getattr(type(config), "__dataclass_fields__", {})
    own, shrunk = vars(config), vars(mini)

    def integers(value: Any) -> bool:  # widths, counts, layer indices: none negative
        items = value if isinstance(value, list) else [value]
        return all(_is_integer(item) and item >= 0 for item in items)

    left = {name for name, value in shrunk.items() if integers(value) and own.get(name) == value}
    defaults = {
        name: field.default
        for name, field in fields.items()
        if name in left and field.default is not dataclasses.MISSING and not _is_integer(field.default)
    }
    try:  # from the fields alone: attributes given beside them are set after the class derives its own
        bare = type(config).from_dict({**_fields(config), **defaults})
        derived = {name for name in defaults if getattr(bare, name) == own[name]}
        fresh = type(config).from_dict({**_fields(mini), **{name: defaults[name] for name in derived}})
    except Exception:  # a config its class does not rebuild from its fields: as it is (the self-check proves it)
        return
    for name in left:
        if (
            (name in derived or name not in fields)
            and integers(value := vars(fresh).get(name))
            and value != shrunk[name]
        ):
            setattr(mini, name, value)


def _cut_per_layer(config: Any, mini: Any, kept: list[int]) -> None:
    """Cut ``mini``'s per-layer lists to the ``kept`` blocks, renumber its lists of layer indices among them, and
    bring its token ids within the miniature's vocabulary."""
    for name, value in vars(config).items():
        if isinstance(value, (list, tuple)) and len(value) == config.num_hidden_layers:
            setattr(mini, name, type(value)(value[i] for i in kept))
        elif name.endswith("_token_id") and isinstance(value, int):
            setattr(mini, name, min(value, SIZES["vocab_size"] - 1))
    for name, indices in _layer_indices(config).items():
        setattr(mini, name, [kept.index(index) for index in indices if index in kept])


def _seq2seq_limits(mini: Any) -> None:
    """Bound an encoder-decoder miniature's :data:`SEQ2SEQ_LIMITS`; its target vocabulary (Marian's) is its
    vocabulary."""
    for name, limit in SEQ2SEQ_LIMITS.items():
        if _is_integer(getattr(mini, name, None)):
            setattr(mini, name, min(getattr(mini, name), limit))
    if _is_integer(getattr(mini, "decoder_vocab_size", None)):
        mini.decoder_vocab_size = mini.vocab_size


def _part_widths(config: Any, mini: Any) -> None:
    """Give the configs nested in ``mini`` without a depth of their own (parts of its blocks: DBRX's ``ffn_config``,
    whose ``hidden_size`` is the model's) the miniature's widths of :data:`SIZES` where theirs equal ``config``'s:
    a part as wide as the model stays as wide as the miniature."""
    from transformers import PretrainedConfig

    for part in vars(mini).values():
        if not isinstance(part, PretrainedConfig) or any(_integer(part, d) for d in SUB_CONFIG_DEPTHS):
            continue
        for name in SIZES:
            value = part.__dict__.get(name)
            if _is_integer(value) and value == getattr(config, name, None):
                setattr(part, name, getattr(mini, name))


STACK_CONFIGS = ("encoder", "decoder")
"""The configs of an encoder-decoder's stacks, where its own config holds them (T5Gemma's)."""


def _joined_stacks(config: Any) -> bool:
    """Whether ``config`` is an encoder-decoder's whose depths are its stacks' configs' (:data:`STACK_CONFIGS`, each
    with ``num_hidden_layers``), none of its own."""
    stacks = [getattr(config, name, None) for name in STACK_CONFIGS]
    joined = getattr(config, "is_encoder_decoder", False) and not _integer(config, "num_hidden_layers")
    return joined and all(_integer(stack, "num_hidden_layers") for stack in stacks)


def _joined_miniature(config: Any) -> Any:
    """The miniature of an encoder-decoder config of :func:`_joined_stacks`: its class built again from its fields,
    each stack's config its miniature (:func:`miniature_config`), its own vocabulary and token ids within the
    miniature's, so that what its class derives from the stacks' (T5Gemma's decoder's cross-attention width, the
    encoder's) follows."""
    fields = config.to_dict()
    fields.update({name: miniature_config(getattr(config, name)).to_dict() for name in STACK_CONFIGS})
    for name, value in fields.items():
        if (name.endswith("_token_id") or name == "vocab_size") and _is_integer(value):
            fields[name] = min(value, SIZES["vocab_size"] - name.endswith("_token_id"))
    mini = type(config).from_dict(fields)
    mini.use_cache = False
    return mini


MIRRORED = ("num_hidden_layers", "hidden_size")
"""The depth and the width, which a config may mirror in fields of its own (:func:`_mirrors`)."""


def _mirrors(config: Any, shrunk: dict[str, int]) -> dict[str, str]:
    """The fields of ``config`` that mirror its depth or width (:data:`MIRRORED`), which the miniature shrinks,
    ``{mirror: shrunk field}``: declared by its
    class without a value of their own (a default of ``None``, which the config's initialisation fills from the
    other: xLSTM's ``num_blocks`` from ``num_hidden_layers``, ``embedding_dim`` from ``hidden_size``) and holding the
    shrunk field's value; the miniature gives them its value too."""
    fields = getattr(type(config), "__dataclass_fields__", {})
    values = {name: vars(config).get(name) for name in MIRRORED if name in shrunk}
    return {
        mirror: name
        for mirror, field in fields.items()
        if field.default is None and mirror not in shrunk and not mirror.endswith("_token_id")
        for name, value in values.items()
        if _is_integer(value) and vars(config).get(mirror) == value
    }


def _language_config(config: Any) -> str | None:
    """``None`` for a config with a depth of its own (``num_hidden_layers``); for a composite one, the name of its
    language model's config (``text_config``, with a depth: Gemma 3's, Voxtral's); else refused: a model of several
    towers without one language model's config (``EncoderDecoderModel``'s two models, BLT's four stacks).

    Raises:
        UnsupportedModelError: naming the nested configs.
    """
    from transformers import PretrainedConfig

    if _integer(config, "num_hidden_layers"):
        return None
    if text_config(config) is not None:
        return TEXT_CONFIG
    towers = [name for name, value in vars(config).items() if isinstance(value, PretrainedConfig)]
    raise UnsupportedModelError(
        f"{type(config).__name__} has no num_hidden_layers of its own but the configs {towers}, none of them a"
        f" language model's `{TEXT_CONFIG}`: a model of several towers (two models joined, or stacks of other kinds),"
        " which no family cuts into one backbone"
    )


SUB_CONFIG_DEPTHS = ("num_hidden_layers", "num_blocks")
"""The depths of a nested config (a multimodal model's vision or audio tower) that the miniature cuts to one."""


def _one_block_towers(config: Any, keep: str | None = None) -> None:
    """Cut each config nested in ``config`` but ``keep`` (Phi-4-multimodal's ``vision_config`` and ``audio_config``:
    towers the embedding layer holds beside the token embedding, which the text-only probe does not run through) to one
    block, widths as given: a miniature need not build 27 full-size vision layers."""
    from transformers import PretrainedConfig

    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig) and name != keep:
            for name in SUB_CONFIG_DEPTHS:
                if _is_integer(getattr(value, name, None)):
                    setattr(value, name, 1)


def _shrunk(get: Callable[[str], Any], grouped: bool) -> dict[str, int]:
    """The miniature's values of the widths and bounds a config (or one layer of it) has, ``get`` reading its values:
    :data:`SIZES`; the head width ``qk_rope_head_dim``'s, times the config's ratio of the two where the rotary part is a
    whole fraction of the head (a ``qk_nope_head_dim`` that fills the rest of the head does so again); the bounds of
    :data:`LIMITS` (experts kept where grouped, ``n_group``); as many key/value heads as attention heads where the
    config has as many; a state-space mixer's heads filling its width (:data:`SSM_HEADS`)."""
    values = {name: size for name, size in SIZES.items() if _is_integer(get(name))}
    rope, head, nope = get("qk_rope_head_dim"), get("head_dim"), get("qk_nope_head_dim")
    if _is_integer(rope) and _is_integer(head):
        ratio = head // rope if rope and head % rope == 0 else 1
        values["head_dim"] = SIZES["qk_rope_head_dim"] * ratio
        if _is_integer(nope) and head == nope + rope and ratio > 1:
            values["qk_nope_head_dim"] = values["head_dim"] - SIZES["qk_rope_head_dim"]
    for name, limit in LIMITS.items():
        if _is_integer(get(name)) and not (name.endswith("experts") and grouped):
            values[name] = min(get(name), limit)
    if get("num_key_value_heads") is not None and get("num_key_value_heads") == get("num_attention_heads"):
        values["num_key_value_heads"] = values.get("num_attention_heads", get("num_attention_heads"))
    hidden = values.get("hidden_size")
    for heads, width, expand in SSM_HEADS:
        if hidden is not None and all(_is_integer(get(name)) for name in (heads, width, expand)):
            values[heads] = max(1, get(expand) * hidden // values.get(width, get(width)))
            if _is_integer(get(SSM_WIDTH)):  # the mixer's width given outright: its heads' again
                values[SSM_WIDTH] = values[heads] * values.get(width, get(width))
    return values


def _derived(config: Any, name: str) -> bool:
    """Whether ``name`` is a read-only property of ``config``'s class, which its other fields give (Falcon's
    ``head_dim``, ``hidden_size // num_attention_heads``): the miniature's follows from theirs."""
    attribute = getattr(type(config), name, None)
    return isinstance(attribute, property) and attribute.fset is None


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integer(config: Any, name: str) -> bool:
    try:
        value = getattr(config, name, None)
    except RuntimeError:  # a per-layer attribute of a heterogeneous config: no global value to shrink
        return False
    return _is_integer(value)


@contextmanager
def _cpu_fp32() -> Iterator[None]:
    """Build on the CPU in fp32 whatever the caller's context (a meta device, a bf16 default dtype)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def built_config(model_class: type, config: Any) -> Any:
    """The config ``transformers``' auto classes build ``model_class`` from: a composite config's text config where
    the class is its language model's (``config_class`` the config's ``text_config`` class: Qwen3.5's, Llama 4's and
    Mllama's causal LMs, as ``AutoModelForCausalLM.from_config`` builds them), else ``config`` itself."""
    text = getattr(config, "sub_configs", {}).get(TEXT_CONFIG)
    if text is not None and getattr(model_class, "config_class", None) is text:
        return config.get_text_config()
    return config


def miniature(model_class: type, config: Any) -> nn.Module:
    """The miniature of ``model_class`` for ``config`` (:func:`miniature_config`), in fp32 on the CPU, every
    parameter drawn at random from a seeded generator (matrices with standard deviation ``1 / sqrt(fan_in)``,
    vectors in [0.5, 1.5]); with the config's attention implementation when it is ``eager`` or ``sdpa``, else (a
    flash or kernel one, or none chosen) ``sdpa`` where the class supports it, else ``eager``."""
    mini = miniature_config(built_config(model_class, config))
    if mini._attn_implementation not in ("eager", "sdpa"):  # flash or a kernel: the CPU runs its reference instead
        mini._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
    with _cpu_fp32():
        model = model_class(mini).float()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, parameter.shape[-1] ** -0.5, generator=generator)
            else:
                parameter.uniform_(0.5, 1.5, generator=generator)
    return model


def probe() -> tuple[Tensor, Tensor]:
    """The probe batch: ``(input_ids, attention_mask)``, each ``(3, 10)`` long; row 1 left-padded by 3, row 2
    right-padded by 2."""
    ids = torch.randint(3, SIZES["vocab_size"], (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    return ids, mask


def _first(value: Any) -> Tensor:
    return value[0] if isinstance(value, tuple) else value


def _received(model: nn.Module, layers: list[HFLayer], ids: Tensor, mask: Tensor, **kwargs: Any):
    """The model's forward on the probe, and what the first module of each backbone layer after the first
    received (its hidden states), by forward pre-hooks: ``(output, [received, ...])``. A module the forward calls
    more than once (NanoChat's final norm, applied to the embeddings too) counts by its first call after the previous
    layer's. A block the forward does not call (:class:`~lightning_gpipe.hf.decoder.SkippedBlock`) is to receive what
    the next layer receives; a layer whose first module is a list the forward never calls itself (AltUp's narrowing
    projections, :mod:`lightning_gpipe.hf.altup`) receives what the layer before's first module gave."""
    calls: list[list[tuple[int, Tensor | None]]] = [[] for _ in layers[1:]]
    order = itertools.count()

    def hook(index: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls[index].append((next(order), args[0] if args else kwargs.get("hidden_states")))

        return record

    def given(index: int) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple, output: Any) -> None:
            calls[index].append((next(order), _first(output)))

        return record

    modules = [model.get_submodule(layer.paths[0]) for layer in layers[1:]]
    handles = [
        modules[i - 1].register_forward_hook(given(i))
        if i and isinstance(m, nn.ModuleList)
        else m.register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, m in enumerate(modules)
    ]
    try:
        output = model(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    received: list[Tensor | None] = []
    after = -1
    for index_calls in calls:
        call = next(((at, value) for at, value in index_calls if at > after), None)
        after = after if call is None else call[0]
        received.append(None if call is None else call[1])
    for index in reversed(range(len(received) - 1)):  # a block the forward skips receives nothing: what follows it
        if received[index] is None and isinstance(layers[index + 1], SkippedBlock):
            received[index] = received[index + 1]
    return output, received


def _difference(ours: Tensor, theirs: Tensor | None, mask: Tensor) -> float:
    """The largest absolute difference over the real tokens (``inf`` for a missing or misshapen tensor)."""
    if theirs is None or ours.shape != theirs.shape:
        return float("inf")
    real = mask.bool() if ours.dim() >= 2 and ours.shape[:2] == mask.shape else slice(None)
    return (ours[real].float() - theirs[real].float()).abs().max().item()


def _compare(model: nn.Module, layers: list[HFLayer], value: tuple, mask: Tensor, labels: Tensor | None):
    """``None`` when every backbone layer's output (and the loss, with ``labels``) equals the model's, else
    ``(layer index or None for the loss, difference)``; the backbone's output is the last one."""
    torch.manual_seed(0)  # both sides draw the same dropout masks if they apply the same dropouts in the same order
    try:
        output, received = _received(model, layers, value[0], mask, **({} if labels is None else {"labels": labels}))
    except Exception as error:
        raise _Failed(error) from error
    expected = [*received, output.logits]
    for index in range(len(layers) - 1):  # AltUp's stack, which its blocks take and give as (n, N, S, H)
        if any(getattr(layer, "stacked", False) for layer in layers[index : index + 2]) and expected[index] is not None:
            expected[index] = from_block(expected[index])
    torch.manual_seed(0)
    for index, layer in enumerate(layers):
        value = _layer_output(index, layer, value)
        difference = _difference(_first(value), expected[index], mask)
        if not difference <= TOLERANCE:
            return index, difference
    if labels is not None:
        loss = causal_lm_loss(value, labels, router_loss_of(model), shift=shifts_labels(type(model)))
        difference = (loss - output.loss).abs().item()
        if not difference <= TOLERANCE:
            return None, difference
    return None


def _describe(model_class: type, mini: nn.Module, family: Any, layers: list[HFLayer], where: tuple, mode: str) -> str:
    index, difference = where
    place = "its loss with labels" if index is None else f"backbone layer {index} ({', '.join(layers[index].paths)})"
    config: Any = text_config(mini.config) or mini.config  # a transformers config (a composite's: its text config)
    config = config.encoder if _joined_stacks(config) else config  # T5Gemma's: its encoder's
    return (
        f"{model_class.__name__} is not cut into backbone layers correctly: {place} differs from the model's own"
        f" forward by {difference:.3g} (largest absolute difference on the real tokens of a left- and right-padded"
        f" probe; allowed {TOLERANCE:g}) {mode}, in a miniature of your config ({config.num_hidden_layers} layers,"
        f" hidden size {config.hidden_size}, fp32, {config._attn_implementation} attention), {family.describe(mini)}."
        " The class's forward computes something that cut does not, so lightning_gpipe.hf refuses it before training"
        " rather than train another model. Register a Family that cuts it (docs/transformers.md, 'Adding a family')."
    )


def _check(model_class: type, config: Any, family_of: Callable[[nn.Module], Any]) -> Any:
    try:
        mini = miniature(model_class, config)
    except UnsupportedModelError:
        raise
    except Exception as error:
        raise _Failed(error) from error
    family = family_of(mini)
    try:
        layers = family.layers(mini)
    except UnsupportedModelError:
        raise
    except Exception as error:
        raise _Failed(error, f"the {family.name} family's cut") from error
    if family.seq2seq:
        try:  # the model's own shift of the labels (a config without decoder_start_token_id cannot)
            seq2seq = seq2seq_probe(mini)
        except Exception as error:
            raise _Failed(error) from error
        _check_modes(model_class, mini, family, layers, _compare_seq2seq, *seq2seq)
        return family
    ids, mask = probe()
    value = encoder_input(ids, mask) if family.encoder else decoder_input(ids, mask)
    labels = None if family.encoder else ids.masked_fill(mask == 0, -100)
    _check_modes(model_class, mini, family, layers, _compare, value, mask, labels)
    return family


def _check_modes(model_class: type, mini: nn.Module, family: Any, layers: list, compare: Callable, *probe: Any) -> None:
    """``compare(mini, layers, value, masks, labels)`` in evaluation mode with labels, then in training mode without.

    Raises:
        SelfCheckError: naming the first backbone layer (or the loss) that differs.
    """
    value, masks, labels = probe
    modes = [
        ("in evaluation mode", False, labels),
        ("in training mode (dropout as configured, seeded alike)", True, None),
    ]
    for mode, training, mode_labels in modes:
        mini.train(training)
        for layer in layers:
            layer.train(training)
        with torch.no_grad():
            where = compare(mini, layers, value, masks, mode_labels)
        if where is not None:
            raise SelfCheckError(_describe(model_class, mini, family, layers, where, mode))


def seq2seq_probe(model: nn.Module) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor], Tensor]:
    """An encoder-decoder's probe: ``(backbone input, (source mask, target mask), labels)``: :func:`probe`'s sources,
    labels ``(3, 7)`` (the last row's last 2 unlabelled), the decoder's input shifted from them as the model's forward
    shifts them."""
    ids, mask = probe()
    labels = torch.randint(3, SIZES["vocab_size"], (ROWS, 7), generator=torch.Generator().manual_seed(2))
    labels[-1, -2:] = -100
    value = seq2seq_input(model, ids, mask, labels=labels)
    return value, (mask, torch.ones_like(labels)), labels


def _anchors(model: nn.Module, layers: list[HFLayer], expected: list) -> list:
    """Hooks recording, for each encoder-decoder backbone layer but the head, the model's value of the hidden states
    it gives: what a stack's first block receives (its embeddings), what a block gives, what a stack gives (its
    final norm)."""
    handles = []

    def keep(index: int, found: Any) -> None:
        if expected[index] is None:
            expected[index] = found[0] if isinstance(found, (tuple, list)) or hasattr(found, "keys") else found

    for index, layer in enumerate(layers[:-1]):
        if isinstance(layer, StackEmbedding):
            first = model.get_submodule(f"{layer.stack.blocks}.0")
            handles.append(
                first.register_forward_pre_hook(
                    lambda m, args, kwargs, i=index: keep(i, args or (kwargs["hidden_states"],)), with_kwargs=True
                )
            )
        else:
            path = layer.block if isinstance(layer, StackBlock) else cast(Any, layer).stack.path
            handles.append(model.get_submodule(path).register_forward_hook(lambda m, a, out, i=index: keep(i, out)))
    return handles  # fmt: skip


def _compare_seq2seq(model: nn.Module, layers: list[HFLayer], value: Any, masks: tuple, labels: Tensor | None):
    """:func:`_compare` for an encoder-decoder: each layer's hidden states (the source's or the target's) against the
    model's (:func:`_anchors`; none where the model's LayerDrop skipped the block), the logits, and the loss with
    ``labels``."""
    expected: list[Any] = [None] * len(layers)
    handles = _anchors(model, layers, expected)
    torch.manual_seed(0)
    source, mask, targets, _ = value
    value = seq2seq_input(model, source, mask, targets, training=model.training)  # the decoder's mask of the mode
    try:
        output = model(input_ids=source, attention_mask=mask, decoder_input_ids=targets, labels=labels)
    except Exception as error:
        raise _Failed(error) from error
    finally:
        for handle in handles:
            handle.remove()
    expected[-1] = output.logits
    torch.manual_seed(0)
    for index, layer in enumerate(layers):
        value = _layer_output(index, layer, value)
        if expected[index] is None:  # a block LayerDrop skipped (and the embeddings before it): as this layer did
            continue
        target = isinstance(value, Tensor) or cast(Any, layer).stack.decoder
        ours, theirs = value if isinstance(value, Tensor) else value[2 if target else 0], expected[index]
        if not target:  # the source's positions (LED and Pegasus-X pad them, Pegasus-X's global tokens first)
            stack = cast(Any, layer).stack
            ours = encoder_output(stack.attention, model.get_submodule(stack.path), ours, masks[0])
            theirs = theirs[:, : masks[0].shape[1]]
        difference = _difference(ours, theirs, masks[1 if target else 0])
        if not difference <= TOLERANCE:
            return index, difference
    if labels is not None:
        difference = (seq2seq_loss(value, labels) - output.loss).abs().item()
        if not difference <= TOLERANCE:
            return None, difference
    return None


def verify(model_class: type, config: Any, family_of: Callable[[nn.Module], Any]) -> Any:
    """Prove the adapter's cut on ``model_class`` with ``config`` (see the module docstring).

    Args:
        model_class: the ``transformers`` model class (``type(model)``: a subclass is checked as itself).
        config: the model's configuration (not changed).
        family_of: the :class:`~lightning_gpipe.hf.Family` that cuts a model (``lightning_gpipe.hf.family_of``).

    Returns:
        The family that cuts the class.

    Raises:
        SelfCheckError: if a backbone layer of the miniature, or its loss, differs from the model's own forward
            (naming the class and the layer); if a backbone layer fails where the model's own forward runs (naming
            the layer and the error: the cut's failure, which ``check=False`` would not step around); or if the
            miniature cannot be built or run (naming the error, and ``check=False`` for a class verified otherwise).
        UnsupportedModelError: if no family takes the miniature, or its family refuses to cut it (a load-balancing
            loss it cannot carry).
    """
    with torch.random.fork_rng():
        try:
            return _check(model_class, config, family_of)
        except _Failed as failed:
            raise SelfCheckError(_unchecked(model_class, failed)) from failed.error


def _unchecked(model_class: type, failed: _Failed) -> str:
    """The message of a check that failed with an error: where, and whether ``check=False`` would help."""
    error = f"{type(failed.error).__name__}: {failed.error}"
    if failed.where is None:  # the model's own side: the miniature could not be built or run
        return (
            f"lightning_gpipe.hf could not check how it cuts {model_class.__name__}: a miniature of your config"
            f" (hidden size {SIZES['hidden_size']}) failed with {error}. Without the check a class may train wrongly"
            " without a word; pass `check=False` to `to_sequential` (`self_check=False` to the LightningModules) only"
            " for a class you have verified yourself."
        )
    return (
        f"{model_class.__name__} is not cut into backbone layers correctly: {failed.where} fails on a miniature of"
        f" your config with {error}, where the model's own forward runs. The cut does not follow this class's"
        " forward (your model would be cut the same way, so skipping the check would not help): register a Family"
        " that cuts it (docs/transformers.md, 'Adding a family')."
    )
