"""The standard decoder layout of ``transformers`` 5, recognised by structure, not by class name.

``transformers`` 5 builds most causal LMs alike (``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Gemma2ForCausalLM``,
``MixtralForCausalLM``...): ``model.embed_tokens``, the blocks ``model.layers[i]`` called with the hidden states,
the rotary cos/sin, the 4-D mask and the cache, ``model.norm``, ``model.rotary_emb`` and ``lm_head``.
:func:`standard_decoder` recognises that layout from the modules and the config, or says why a model is not of it
(:func:`base_model_reason`, :func:`layer_types_reason`, :func:`block_arguments_reason`; :func:`kv_sharing_reason` for
layers the adapter cannot carry). What the model's forward gives its blocks besides the hidden states, and the blocks
get where they ask for it (:class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock`): a value carried from block to
block (``prev_...``, :data:`CARRIED`), what their modeling module computes from the positions
(:func:`computed_arguments`), rotary tables of several kinds (:func:`rotary_kinds`) or for one layer type only
(:func:`rotary_layer_types`); rotary modules per layer theta (:func:`theta_rotaries`); the final norm applied to the
embeddings too (:func:`norm_before_blocks`); arguments the forward passes on as given, ``None`` on text
(:func:`passed_arguments`), and blocks it skips without them (:func:`skipped_block`: Mllama's cross-attention layers);
hyper-connection streams the embeddings are widened into and a module collapsing them after the blocks
(:func:`hyper_streams`, :func:`collapse_name`: Qwen4-Exp's ``hyper_connection_mixer``, in place of the norm); the token
ids (:func:`token_argument`), padding replaced where the forward does (:func:`padding_token`); both masks for every
block of a model of one attention and one recurrent layer type
(:func:`~lightning_gpipe.hf.masks.mixed_masks`). Blocks run in several loops are refused (:func:`block_loops_reason`);
so is cached decoding where the forward keeps state on the cache itself (:func:`cache_state`).
Whatever else a class does differently is caught by the self-check (:mod:`lightning_gpipe.hf.selfcheck`) before the
first step.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any, cast

from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.hf.layer import PreTrainedModel
from lightning_gpipe.hf.masks import HYBRID, MASKS, layer_type, mixed_masks, recurrent_type

STANDARD_BASE = ("embed_tokens", "layers", "norm", "rotary_emb")
"""The modules of a standard decoder's base model, and nothing else."""


ROTARY = "rotary_emb"
"""The base model's child that is its rotary embedding (a declared plan leaves it out; every block's layer calls it)."""


BLOCK_ARGUMENTS = frozenset(
    ("hidden_states", "attention_mask", "position_embeddings", "position_ids", "cache", "layer_past", "use_cache")
    + ("output_attentions", "per_layer_input", "shared_kv_states", "input_ids")
)
"""The named arguments a decoder block may take: what the adapter gives it as the model's forward does (the hidden
states, the 4-D mask, the rotary cos/sin, the positions, the cache, as ``cache`` or GPT-NeoX's ``layer_past``, and
whether to use it), and ``output_attentions``, which both leave at its default; besides one named ``prev_...``
(:data:`CARRIED`)."""


CARRIED = "prev_"
"""The prefix of a block argument that takes what the previous block gave (GLM-MoE-DSA's ``prev_topk_indices``):
such a block returns ``(hidden, that value)`` and :class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock` carries it
to the next block."""


ADVICE = (
    "Register a Family whose layers compute what the model's forward gives its blocks (docs/transformers.md, 'Adding"
    " a family')"
)
"""What a user can do about a decoder the adapter does not take."""


def base_name(model: nn.Module) -> str:
    """The name of ``model``'s base model among its children: its ``base_model_prefix`` where that names one; else
    (Llama 4's and Mllama's causal LMs name ``language_model`` for their multimodal checkpoints' names, but hold
    ``model``) the one child besides ``lm_head`` that is a model of ``model``'s config class; else the prefix."""
    prefix = getattr(model, "base_model_prefix", "")
    found = children(model)
    if prefix in found:
        return prefix
    config = getattr(model, "config", None)
    own = [
        name
        for name, child in found.items()
        if name != "lm_head" and isinstance(child, PreTrainedModel) and type(child.config) is type(config)
    ]
    return own[0] if len(own) == 1 else prefix


def base_model_reason(model: nn.Module, head: str = "lm_head") -> str | None:
    """``None`` when ``model``'s children are exactly its base model (:func:`base_name`) and its output head
    ``head`` (default ``lm_head``); else why not."""
    prefix = base_name(model)
    names = sorted(name for name, child in children(model).items() if child is not None)
    if prefix not in names:
        return (
            f"its base_model_prefix {prefix!r} names none of its children {names}, none of which is a model of its"
            f" config's class. {ADVICE}"
        )
    if names != sorted([prefix, head]):
        return f"its children are {names}, not exactly the base model `{prefix}` and {head}"
    return None


def layer_types_reason(config: Any, rotary: nn.Module | None = None) -> str | None:
    """``None`` when the adapter rebuilds the mask the model's forward gives every layer type of ``config``, else why
    not: a type neither in :data:`~lightning_gpipe.hf.masks.MASKS` nor in :data:`~lightning_gpipe.hf.masks.HYBRID`.
    (A type the config gives no rotary parameters, with a ``rotary`` module per layer type, gets no rotary embedding
    and what its modeling module computes for it instead: Beam's ``full_attention`` layers,
    :func:`computed_arguments`.)"""
    types = sorted({layer_type(config, i) for i in range(config.num_hidden_layers)})
    unknown = [t for t in types if t not in MASKS and t not in HYBRID]
    if unknown:
        return (
            f"its layer types include {unknown}, which the adapter does not know: it rebuilds the masks"
            f" {', '.join([*MASKS, *HYBRID])} layers take (transformers' LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING)."
            f" {ADVICE}"
        )
    return None


def rotary_kinds(config: Any) -> list[str]:
    """The kinds of rotary table a config names that are no layer types (DeepSeek-V4's ``rope_parameters`` ``{"main":
    ..., "compress": ...}``): the model's forward gives every block all of them, ``{kind: (cos, sin)}``; empty where
    the config's rotary parameters are one set or one per layer type."""
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope or not all(isinstance(v, dict) for v in rope.values()):
        return []
    types = {layer_type(config, i) for i in range(config.num_hidden_layers)}
    return [] if types & set(rope) else list(rope)


@functools.cache
def _forward_tree(base_class: Any) -> ast.AST | None:
    """The syntax tree of the forward of ``base_class`` (decorators unwrapped), or ``None`` where its code cannot be
    read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(base_class.forward))))
    except (OSError, TypeError, AttributeError, SyntaxError):
        return None


def rotary_layer_types(base_class: Any) -> frozenset[str] | None:
    """The layer types whose blocks the forward of ``base_class`` (a base model's class) gives the rotary tables,
    where its code gives them to one type only: the blocks' argument ``position_embeddings=<tables> if <name> ==
    "<type>" else None`` (Lara-mini's, whose full-attention layers use no positional encoding); ``None`` where it gives
    no such argument (every block gets the tables), or its code cannot be read. The self-check proves the reading."""
    tree = _forward_tree(base_class)
    for node in [] if tree is None else ast.walk(tree):
        if not (isinstance(node, ast.keyword) and node.arg == "position_embeddings"):
            continue
        value = node.value
        if isinstance(value, ast.IfExp) and isinstance(value.orelse, ast.Constant) and value.orelse.value is None:
            test = value.test
            if isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.Eq):
                compared = test.comparators[0]
                if isinstance(compared, ast.Constant) and isinstance(compared.value, str):
                    return frozenset([compared.value])
    return None


def mask_keys(base_class: Any) -> tuple[str, str] | None:
    """The keys under which the forward of ``base_class`` (the module holding the blocks) gives its blocks a hybrid
    layer type's two masks in one dict, ``attention_mask={"causal": ..., "conv": ...}`` (Zaya's): ``(the attention
    mask's key, the recurrent mask's)``, the recurrent one the key naming a recurrent layer type
    (:func:`~lightning_gpipe.hf.masks.recurrent_type`); ``None`` where its code gives no such dict, or cannot be read.
    The self-check proves the reading."""
    tree = _forward_tree(base_class)
    for node in [] if tree is None else ast.walk(tree):
        if not (isinstance(node, ast.keyword) and node.arg == "attention_mask" and isinstance(node.value, ast.Dict)):
            continue
        keys = [key.value for key in node.value.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)]
        recurrent = [key for key in keys if recurrent_type(key)]
        if len(keys) == len(node.value.keys) == 2 and len(recurrent) == 1:
            return next(key for key in keys if key != recurrent[0]), recurrent[0]
    return None


def passed_arguments(base_class: Any) -> frozenset[str]:
    """The arguments of the forward of ``base_class`` (a base model's class) that default to ``None`` and that it
    passes on as given (a keyword ``name=name``, the name never assigned): Mllama's ``cross_attention_states``,
    ``cross_attention_mask`` and ``full_text_row_masked_out_mask``, which its blocks get ``None`` on text alone, as
    the adapter gives them (their default; a batch carrying them is refused, :func:`~lightning_gpipe.hf.composite.
    unused_inputs`). Empty where its code cannot be read. The self-check proves the reading."""
    tree = _forward_tree(base_class)
    if tree is None:
        return frozenset()
    parameters = inspect.signature(inspect.unwrap(base_class.forward)).parameters.values()
    optional = {p.name for p in parameters if p.default is None}
    assigned = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    passed = {
        node.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and isinstance(node.value, ast.Name) and node.value.id == node.arg
    }
    return frozenset(passed & optional - assigned)


def skipping_arguments(base_class: Any, blocks: str = "layers") -> frozenset[str]:
    """The arguments whose absence makes the forward of ``base_class`` skip blocks: ``name`` where its loop over
    ``self.<blocks>`` holds ``if ... name is None ...: continue`` (Mllama's text-only path, which skips its
    cross-attention layers without ``cross_attention_states``); a block whose forward requires such an argument
    (:func:`skipped_block`) is skipped on text. Empty where its code cannot be read."""
    tree = _forward_tree(base_class)
    skips = [
        node.test
        for loop in ([] if tree is None else ast.walk(tree))
        if isinstance(loop, ast.For) and _loops_over(loop, blocks)
        for node in ast.walk(loop)
        if isinstance(node, ast.If) and len(node.body) == 1 and isinstance(node.body[0], ast.Continue)
    ]
    return frozenset(
        test.left.id
        for skip in skips
        for test in ast.walk(skip)
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and isinstance(test.ops[0], ast.Is)
        and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
    )  # fmt: skip


def skipped_block(base: nn.Module, block: nn.Module) -> bool:
    """Whether the forward of the base model ``base`` skips ``block`` on text alone: the block's forward requires
    (no default) an argument the base model's forward passes on as given (:func:`passed_arguments`), ``None`` on text,
    and whose ``None`` makes it skip blocks (:func:`skipping_arguments`): Mllama's cross-attention layers. The
    adapter's layer for it passes the value on (:class:`~lightning_gpipe.hf.decoder.SkippedBlock`); the self-check
    proves the reading."""
    base_class = cast(Any, type(base))
    absent = passed_arguments(base_class) & skipping_arguments(base_class)
    parameters = inspect.signature(block.forward).parameters.values()
    return any(p.name in absent and p.default is inspect.Parameter.empty for p in parameters)


def _loops_over(node: ast.AST, blocks: str) -> bool:
    """Whether ``node`` holds a ``for`` statement over ``self.<blocks>`` (or a slice of it, ``enumerate`` of it)."""
    return any(
        isinstance(loop, ast.For)
        and any(
            isinstance(sub, ast.Attribute) and sub.attr == blocks and isinstance(sub.value, ast.Name)
            and sub.value.id == "self"
            for sub in ast.walk(loop.iter)
        )
        for loop in ast.walk(node)
    )  # fmt: skip


def block_loops_reason(base: nn.Module, blocks: str = "layers") -> str | None:
    """``None`` unless the forward of the base model ``base`` runs its blocks (the ``nn.ModuleList`` ``blocks``) in
    several loops one after the other: two statements of one block of code that each loop over ``self.<blocks>``
    (Dory's input, recurrent and output sections, the recurrent one run ``n_recurrent_loops`` times with the section's
    input added back), which no one pass through the blocks in order follows. Loops in other branches of an ``if``
    (xLSTM's chunked inference) are one pass each."""
    tree = _forward_tree(cast(Any, type(base)))  # a class: hashable
    bodies = [] if tree is None else [v for node in ast.walk(tree) for v in vars(node).values() if isinstance(v, list)]
    for body in bodies:
        count = sum(isinstance(statement, ast.stmt) and _loops_over(statement, blocks) for statement in body)
        if count > 1:
            return (
                f"its forward runs its blocks in {count} loops one after the other (sections of blocks, or blocks run"
                f" more than once), which one pass through the blocks in order does not follow. {ADVICE}"
            )
    return None


def computed_arguments(block: nn.Module) -> dict[str, Callable[[Tensor], Tensor]]:
    """The arguments of ``block`` that its modeling module computes from the positions, by name: ``X`` where the
    module defines ``compute_X(position_ids)`` (Beam's ``attention_scaling``, which its forward gives the layers of
    a type without rotary parameters, and ``None`` the others; see
    :class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock`)."""
    module = sys.modules.get(type(block).__module__)
    names = inspect.signature(block.forward).parameters
    found = {name: getattr(module, f"compute_{name}", None) for name in names}
    return {name: compute for name, compute in found.items() if callable(compute)}


PER_LAYER = ("get_per_layer_inputs", "project_per_layer_inputs")
"""The methods of a base model that computes per-layer inputs for its blocks from the tokens and the embeddings
(Gemma 4's per-layer embeddings): the embedding layer calls them (:class:`~lightning_gpipe.hf.decoder_cut.DecoderCut`'s
``per_layer``)."""


def per_layer_module(base: nn.Module, name: str) -> bool:
    """Whether ``base``'s child ``name`` is one of its per-layer embedding modules: named ``...per_layer...`` in a base
    model with the per-layer embedding methods (:data:`PER_LAYER`: Gemma 4's ``embed_tokens_per_layer``,
    ``per_layer_model_projection``, ``per_layer_projection_norm``; not Gemma 3n's ``altup_projections``), which the
    embedding layer holds and computes the per-layer inputs with. The self-check proves the reading."""
    return "per_layer" in name and all(callable(getattr(base, method, None)) for method in PER_LAYER)


def kv_sharing_reason(config: Any) -> str | None:
    """``None`` unless layers of ``config`` reuse the keys and values of earlier layers (``num_kv_shared_layers``)
    without the config telling which layer stores them for which (``kv_sharing_modes``, ``"store"`` and ``"reuse"``
    per layer: Gemma 3n's, Gemma 4's, whose stored keys and values the adapter carries from block to block,
    :class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock`)."""
    shared = getattr(config, "num_kv_shared_layers", 0)
    if shared and getattr(config, "kv_sharing_modes", None) is None:
        return (
            f"its last {shared} layers reuse the keys and values of earlier layers (num_kv_shared_layers={shared}),"
            " and its config does not say which layer stores them (kv_sharing_modes), so the adapter cannot carry"
            f" them between blocks. {ADVICE}"
        )
    return None


def block_arguments_reason(block: nn.Module, config: Any = None, passed: frozenset[str] = frozenset()) -> str | None:
    """``None`` when ``block``'s forward takes no named argument beyond :data:`BLOCK_ARGUMENTS` (and one named
    ``prev_...``, :data:`CARRIED`; where ``config`` has a layer type of :data:`~lightning_gpipe.hf.masks.HYBRID`, or
    one attention and one recurrent type, :func:`~lightning_gpipe.hf.masks.mixed_masks`, one more ``..._mask``; any of
    ``passed``, the arguments the model's forward passes on as given, :func:`passed_arguments`, left at their default
    ``None``, or gives the token ids, :func:`token_argument`), else why not (the model's forward computes something
    else for it: Beam's ``attention_scaling``)."""
    parameters = inspect.signature(block.forward).parameters.values()
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    given = BLOCK_ARGUMENTS | {p.name for p in parameters if p.name in passed and p.default is None}
    extra = [p.name for p in parameters if p.kind in named and p.name not in given]
    extra = [name for name in extra if name not in computed_arguments(block)]
    carried = [name for name in extra if name.startswith(CARRIED)]
    masks = [name for name in extra if name.endswith("_mask")]
    hybrid = config is not None and any(layer_type(config, i) in HYBRID for i in range(config.num_hidden_layers))
    hybrid = hybrid or (config is not None and mixed_masks(config) is not None and len(masks) == 1)
    if hybrid and len(masks) != 1:
        return (
            f"its layer types take an attention and a recurrent mask at once ({', '.join(HYBRID)}), but its blocks"
            f" ({type(block).__name__}) take {len(masks)} mask arguments besides attention_mask, not one. {ADVICE}"
        )
    for allowed in (carried, masks if hybrid else []):
        if len(allowed) == 1:
            extra.remove(allowed[0])
    if extra:
        return (
            f"its blocks ({type(block).__name__}) take {extra}, which the model's forward computes for them and the"
            f" adapter does not. {ADVICE}"
        )
    return None


def bidirectional(config: Any) -> bool:
    """Whether ``config``'s text tokens attend both ways: ``use_bidirectional_attention`` ``True`` or ``"all"``
    (Gemma 4 Unified's ``"vision"``: only image tokens do, the text stays causal)."""
    value = getattr(config, "use_bidirectional_attention", False)
    return value is True or value == "all"


def theta_rotaries(config: Any, base: nn.Module, child: nn.Module) -> bool:
    """Whether ``child`` of the base model ``base`` is an ``nn.ModuleList`` of modules of the class of its rotary
    embedding (``rotary_emb``) where ``config`` gives each layer its ``layer_rope_theta`` (Granite-SWA's and
    Granite-MoE-SWA's ``rotary_embs``, one per theta: each block calls its own theta's, none for 0; see
    :func:`~lightning_gpipe.hf.decoder_cut.block_rotary`)."""
    rotary = getattr(base, ROTARY, None)
    per_layer = getattr(config, "layer_rope_theta", None)
    if not isinstance(child, nn.ModuleList) or rotary is None or not isinstance(per_layer, (list, tuple)):
        return False
    return bool(len(child)) and all(type(member) is type(rotary) for member in child)


def theta_rotaries_name(model: nn.Module) -> str | None:
    """The name of the one child of ``model``'s base model (:func:`base_name`) that holds rotary modules per layer
    theta (:func:`theta_rotaries`), or ``None``."""
    base = model.get_submodule(base_name(model))
    config = getattr(model, "config", None)
    found = [n for n, child in children(base).items() if child is not None and theta_rotaries(config, base, child)]
    return found[0] if len(found) == 1 else None


def forward_names(module: nn.Module) -> list[str]:
    """The global and attribute names ``module``'s forward uses, in the order its code first uses them (its class's
    forward, decorators unwrapped): what the layouts read the order of a forward's steps from."""
    return list(inspect.unwrap(type(module).forward).__code__.co_names)


def norm_before_blocks(base: nn.Module) -> bool:
    """Whether ``base``'s forward applies its final norm ``norm`` before its blocks ``layers`` too (NanoChat's
    "additional norm before the layers"): read from the names its code uses, ``norm`` first named before ``layers``
    (decorators unwrapped). The self-check proves the reading."""
    names = forward_names(base)
    return {"norm", "layers"} <= set(names) and names.index("norm") < names.index("layers")


def hyper_streams(base: nn.Module) -> tuple[int, bool] | None:
    """``(streams, flat)`` where the forward of the base model ``base`` widens its embeddings into hyper-connection
    streams, ``streams`` copies each: ``x.unsqueeze(2).expand(-1, -1, self.config.<n>, -1)``, ``(N, S, streams, H)``
    (HY-V4's, DeepSeek-V4's ``hc_mult``; ``flat`` False), or ``x.repeat(1, 1, self.config.<n>)``, ``(N, S, streams *
    H)`` (Qwen4-Exp's ``hc_count``; ``flat`` True), read from its code; else ``None``. The self-check proves the
    reading."""
    tree = _forward_tree(cast(Any, type(base)))
    for node in [] if tree is None else ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        shape = [ast.unparse(argument) for argument in node.args]
        field = next((item[len("self.config.") :] for item in shape if item.startswith("self.config.")), None)
        count = getattr(getattr(base, "config", None), field or "", None)
        if not isinstance(count, int):
            continue
        if node.func.attr == "repeat" and shape[:2] == ["1", "1"] and len(shape) == 3:
            return count, True
        if node.func.attr == "expand" and shape[:2] == ["-1", "-1"] and shape[3:] == ["-1"]:
            return count, False
    return None


def collapse_name(base: nn.Module) -> str | None:
    """The name of the child of the base model ``base`` that collapses its hyper-connection streams
    (:func:`hyper_streams`) after the blocks: its one child besides :data:`STANDARD_BASE` (Qwen4-Exp's
    ``hyper_connection_mixer``, which gives the hidden states ``(N, S, H)`` in place of a final norm); ``None``
    without streams, or with other children than these."""
    others = [name for name, child in children(base).items() if child is not None and name not in STANDARD_BASE]
    return others[0] if len(others) == 1 and hyper_streams(base) is not None else None


def _base_modules(base: nn.Module) -> list[str]:
    """:data:`STANDARD_BASE`, without ``norm`` where ``base`` collapses hyper-connection streams
    (:func:`collapse_name`) and holds no norm."""
    if collapse_name(base) is not None and "norm" not in children(base):
        return [name for name in STANDARD_BASE if name != "norm"]
    return list(STANDARD_BASE)


def token_argument(base: nn.Module, block: nn.Module) -> str | None:
    """The argument of ``block`` that takes the token ids: ``input_ids`` (DeepSeek-V4's hash-routed experts), or the
    one ``..._input_ids`` the forward of the base model ``base`` takes too and gives every block (Qwen4-Exp's
    ``ple_input_ids``, the ids its per-layer embeddings hash: :func:`padding_token`); ``None`` where it takes
    neither."""
    names = inspect.signature(block.forward).parameters
    if "input_ids" in names:
        return "input_ids"
    own = inspect.signature(inspect.unwrap(cast(Any, type(base)).forward)).parameters
    found = [name for name in names if name.endswith("_input_ids") and name in own]
    return found[0] if len(found) == 1 else None


def padding_token(base: nn.Module) -> int | None:
    """The id the forward of the base model ``base`` gives its blocks' per-layer token ids (:func:`token_argument`)
    in place of the padding the recurrent mask masks: ``config.eos_token_id`` (the first of a list) where its code
    names ``eos_token_id`` (Qwen4-Exp's ``torch.where(conv_mask.bool(), ple_input_ids, eos_token_id)``, after which
    its n-grams restart), else ``None`` (the ids as given). The self-check proves the reading on padded rows."""
    if "eos_token_id" not in forward_names(base):
        return None
    eos = getattr(getattr(base, "config", None), "eos_token_id", None)
    return eos[0] if isinstance(eos, (list, tuple)) and eos else eos if isinstance(eos, int) else None


def cache_state(base: nn.Module) -> list[str]:
    """The attributes the forward of the base model ``base`` sets on objects other than itself (Qwen4-Exp's
    ``indexer_cache.indexer_position_ids``: the positions of every token so far, kept on its cache for the rotary
    tables its indexers get): state of the whole model's cache that no block keeps, so that cached decoding through
    the pipeline, each block with its own cache, cannot follow it (refused:
    :class:`~lightning_gpipe.hf.decoder.RotaryDecoderBlock`)."""
    tree = _forward_tree(cast(Any, type(base)))
    return sorted(
        ast.unparse(node)
        for node in ([] if tree is None else ast.walk(tree))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    )  # fmt: skip


def standard_decoder(model: nn.Module) -> str | None:
    """``None`` when ``model`` is of the standard decoder layout (see the module docstring), else why not: its
    children must be exactly the base model (:func:`base_name`) and ``lm_head``, the base model's exactly
    :data:`STANDARD_BASE` (and an ``nn.ModuleList`` of rotary modules per layer theta, :func:`theta_rotaries`; a module
    collapsing hyper-connection streams, before the norm or in its place, :func:`collapse_name`; the blocks an
    ``nn.ModuleList`` of ``num_hidden_layers``), every layer type one the adapter rebuilds
    (:func:`layer_types_reason`) and the blocks taking what it gives them (:func:`block_arguments_reason`)."""
    if not isinstance(model, PreTrainedModel):
        return "it is not a transformers PreTrainedModel"
    reason = base_model_reason(model)
    if reason is not None:
        return reason
    prefix, config = base_name(model), model.config
    base = model.get_submodule(prefix)
    inner = sorted(name for name, child in children(base).items() if child is not None)
    rotaries = theta_rotaries_name(model)  # Granite-MoE-SWA's rotary modules per layer theta besides
    collapse = collapse_name(base)  # Qwen4-Exp's hyper-connection mixer, in place of the norm
    if sorted(name for name in inner if name not in (rotaries, collapse)) != sorted(_base_modules(base)):
        return (
            f"`{prefix}` holds {inner}, not exactly {list(STANDARD_BASE)} (with hyper-connection streams, one module"
            " collapsing them in place of the norm or before it)"
        )
    if not isinstance(base.layers, nn.ModuleList) or len(base.layers) != config.num_hidden_layers:
        return f"`{prefix}.layers` is not an nn.ModuleList of num_hidden_layers blocks"
    if bidirectional(config):
        return "use_bidirectional_attention=True (a bidirectional encoder, not a causal LM)"
    token = token_argument(base, base.layers[0])  # Qwen4-Exp's ple_input_ids: the token ids
    tokens = frozenset([] if token is None else [token])
    return (
        layer_types_reason(config, base.get_submodule("rotary_emb"))
        or block_arguments_reason(base.layers[0], config, passed_arguments(type(base)) | tokens)
        or block_loops_reason(base)
    )
