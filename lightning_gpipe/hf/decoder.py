"""A decoder's backbone layers: the embeddings (:class:`DecoderEmbedding`), one layer per block
(:class:`RotaryDecoderBlock` for the standard layout of ``transformers`` 5, :class:`GPT2Block`, :class:`GPT2LikeBlock`
for the GPT-2-like layout of :mod:`lightning_gpipe.hf.gpt2_like`), the final norm
(:class:`FinalNorm`) and the head (:class:`Head`); and the causal LM loss of their output (:func:`causal_lm_loss`).
Where a model is cut into them: :mod:`lightning_gpipe.hf.decoder_cut`.

Between layers only tensors travel, each with the batch in dim 0: ``(hidden (N, S, H), attention_mask (N, S),
position_ids (N, S)[, router statistics (N, 2E + 1)][, per-layer inputs (N, S, L, D)][, token ids (N, S)][, carried
(N, S, k)][, documents (N, S)][, rows (n,)])`` (``documents`` for packed rows,
:func:`~lightning_gpipe.hf.packing.decoder_input`; ``rows`` for cached decoding,
:class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`; per-layer inputs, token ids and a carried value only for the
models whose blocks take them, the carried value being the embeddings ``(N, S, H)`` for blocks that read them at every
layer, Zamba's; with hyper-connections the hidden states are ``(N, S, streams, H)``, or ``(N, S, streams * H)``).
Each block rebuilds what the model's forward builds once for all blocks (the 4-D mask, :mod:`lightning_gpipe.hf.masks`,
kept inside each document of a packed row; the rotary cos/sin from the positions) and calls the block as the model's
forward does, giving it what the forward gives it where it asks for it (a value carried from block to block,
``prev_...``; what its modeling module computes from the positions; the token ids, :func:`tokens_of`; rotary tables of
several kinds: :mod:`lightning_gpipe.hf.decoder_layout`).
"""

from __future__ import annotations

import copy
import inspect
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import set_buffer
from lightning_gpipe.hf.altup import collapse, expand, from_block, to_block
from lightning_gpipe.hf.decoder_layout import (
    CARRIED,
    cache_state,
    computed_arguments,
    mask_keys,
    padding_token,
    rotary_kinds,
    rotary_layer_types,
    token_argument,
)
from lightning_gpipe.hf.kv_cache import CachedDecoderBlock
from lightning_gpipe.hf.layer import HFLayer, PreTrainedModel
from lightning_gpipe.hf.masks import MASKS, layer_type, mixed_masks
from lightning_gpipe.hf.moe import RouterLoss
from lightning_gpipe.hf.seq2seq import seq2seq_loss

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error


def causal_lm_loss(
    output: Tensor | tuple[Tensor, Tensor],
    labels: Tensor,
    router: RouterLoss | None,
    num_targets: int | None = None,
    shift: bool = True,
) -> Tensor:
    """A causal LM's loss from its backbone's output, as the model's forward computes it with ``labels``.

    Next-token cross-entropy over the labelled tokens (``ForCausalLMLoss``: ``labels`` ``(N, S)`` long, ``-100``
    where no loss is wanted), plus ``router.coefficient`` times the load-balancing loss of the router statistics
    when the output is ``(logits (N, S, V), statistics (N, 2E + 1))`` (a mixture of experts with
    ``output_router_logits=True``, see :mod:`lightning_gpipe.hf.moe`). The cross-entropy is the mean over these
    labelled tokens, or with ``num_targets`` their sum over ``num_targets`` (``transformers``' ``num_items_in_batch``:
    the targets of a whole batch of which ``labels`` are some rows). With ``shift=False`` each position's logits
    are scored against its own label, unshifted, as the causal LMs of BART's family compute their loss
    (:func:`shifts_labels`).
    """
    logits, statistics = output if isinstance(output, tuple) else (output, None)
    if shift:
        # an int divides on the device (transformers takes one, though it annotates a tensor): no host-to-device copy
        loss = ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=cast(Any, num_targets))
    else:  # as an encoder-decoder's decoder scores its (shifted) input
        loss = seq2seq_loss(logits, labels, num_targets=num_targets)
    if statistics is not None and router is not None:
        loss = loss + router.coefficient * router.aux_loss(statistics)
    return loss


def shifts_labels(model_class: type) -> bool:
    """Whether ``model_class``'s forward shifts its ``labels`` (next-token cross-entropy: ``self.loss_function``,
    ``ForCausalLMLoss``, as nearly every causal LM), or scores each position's logits against its own label
    (``CrossEntropyLoss`` over logits and labels as given: the causal LMs of BART, mBART, Marian, Pegasus, PLBart,
    Blenderbot, TrOCR, whose labels come shifted like an encoder-decoder's; a ``CrossEntropyLoss`` after a local
    ``shift_labels`` shifts them by hand: Qwen2-Audio, Granite Speech): read from the names its ``forward``
    uses (subclasses first, decorators unwrapped), ``True`` where none tells. The self-check compares the loss, so a
    class read wrongly is refused."""
    for cls in model_class.__mro__:
        forward = cls.__dict__.get("forward")
        code = getattr(inspect.unwrap(forward), "__code__", None) if forward is not None else None
        if code is not None and "loss_function" in code.co_names:
            return True
        if code is not None and "CrossEntropyLoss" in code.co_names:
            return "shift_labels" in code.co_varnames  # shifted by hand before the loss: Qwen2-Audio, Granite Speech
    return True


def _unpack(value: tuple[Tensor, ...], router: RouterLoss | None, tokens: bool = False):
    """``(hidden, attention_mask, position_ids, statistics, documents, rows)`` of a decoder value, ``None`` for what
    it does not carry: packed rows carry ``documents`` ``(N, S)``, cached decoding ``rows`` ``(n,)`` (and a value
    carried from block to block, :func:`carried_of`, has 3 dimensions or more). With ``tokens`` the value carries the
    token ids ``(N, S)`` for the blocks (:func:`tokens_of`) before ``documents``."""
    hidden, attention_mask, position_ids, *rest = value
    statistics = rest.pop(0) if router is not None else None
    documents = [item for item in rest if item.dim() == 2][1 if tokens else 0 :]
    rows = next((item for item in rest if item.dim() == 1), None)
    return hidden, attention_mask, position_ids, statistics, next(iter(documents), None), rows


def tokens_of(value: tuple[Tensor, ...], router: RouterLoss | None) -> Tensor:
    """The token ids ``(N, S)`` a value carries for blocks that take them (DeepSeek-V4's, whose hash-routed experts
    choose by token, see :class:`DecoderEmbedding`): its first item of 2 dimensions after the hidden states, mask,
    positions and router statistics."""
    return next(item for item in value[4 if router is not None else 3 :] if item.dim() == 2)


def carried_of(value: tuple[Tensor, ...], dim: int = 3) -> Tensor | None:
    """The item after the hidden states, mask and positions with ``dim`` dimensions, or ``None`` (router statistics
    have 2, ``documents`` 2, ``rows`` 1): with 3, the value a block gave the next (GLM-MoE-DSA's top-k indices ``(N, S,
    k)``, see :class:`RotaryDecoderBlock`); with 4, the per-layer inputs ``(N, S, L, D)`` the embedding gives every
    block (Gemma 4's, see :class:`DecoderEmbedding`)."""
    return next((item for item in value[3:] if item.dim() == dim), None)


def shared_of(value: tuple[Tensor, ...]) -> list[Tensor]:
    """The keys and values earlier blocks stored for the layers reusing them, ``(N, 2, kv heads, S, head width)``
    each, in the order of the blocks (the value's items of 5 dimensions, see :class:`RotaryDecoderBlock`)."""
    return [item for item in value[3:] if item.dim() == 5]


def _pack(*items: Tensor | None) -> tuple[Tensor, ...]:
    return tuple(item for item in items if item is not None)


class DecoderEmbedding(HFLayer):
    """Token (and learned position) embeddings of a decoder: ``(input_ids, attention_mask, position_ids[,
    documents][, rows])``, each ``(N, S)`` long (packed rows' ``documents``, see
    :func:`~lightning_gpipe.hf.packing.decoder_input`; rows ``(n,)``, see
    :class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`), to ``(hidden (N, S, H), attention_mask, position_ids[,
    statistics][, embeddings][, documents][, rows])``.

    Args:
        model: the model.
        tokens: path of the token embedding (``"model.embed_tokens"``).
        positions: path of a learned position embedding (GPT-2's ``"transformer.wpe"``), or ``None`` (rotary).
        dropout: path of the dropout after the embeddings, or ``None``.
        multiplier: a factor on the embeddings (Granite's ``config.embedding_multiplier``), or ``None``.
        dropout_p: the probability of a dropout on the embeddings in training (StarCoder 2's
            ``config.embedding_dropout``, as ``nn.functional.dropout``), or ``None``.
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss`: the layer starts each row's router
            statistics at zero; ``None`` (default) for none.
        extensions: paths of modules the model's forward applies to ``(input_ids, embeddings)`` right after the
            token embedding (Phi-4-multimodal's ``embed_tokens_extend``, which merges image and audio features
            into the embeddings and, for text, gives them back unchanged); default none.
        per_layer: ``(path of the base model, paths of its per-layer embedding modules)`` for a model whose base
            model computes per-layer inputs from the tokens and the embeddings (Gemma 4's ``get_per_layer_inputs``
            and ``project_per_layer_inputs``): the layer computes them as its forward does and passes them on, ``(N,
            S, L, D)`` after the positions (and router statistics), for each block to take its own; ``None``
            (default) for none.
        streams: ``(count, flat)`` of hyper-connection streams
            (:func:`~lightning_gpipe.hf.decoder_layout.hyper_streams`): the embeddings are repeated into ``(N, S,
            count, H)`` for the blocks (HY-V4's ``config.hc_mult``), or with ``flat`` into ``(N, S, count * H)``
            (Qwen4-Exp's ``config.hc_count``), as the model's forward does; ``None`` (default) for none.
        pass_tokens: pass the token ids on to blocks that take them (DeepSeek-V4's ``input_ids``, see
            :func:`tokens_of`); default ``False``.
        altup: path of the modules that widen the embeddings into AltUp's stack of predictions (Gemma 3n's
            ``"model.altup_projections"``, :func:`~lightning_gpipe.hf.altup.expand`): the blocks take ``(N, S, n,
            H)``; ``None`` (default) for none.
        pass_embeddings: pass the embeddings on beside the hidden states, ``(N, S, H)`` after the token ids, to blocks
            that read them at every layer (Zamba's ``original_hidden_states``, see
            :class:`GPT2LikeBlock`); default ``False``.
        held: paths of modules the layer holds without calling them (a composite model's towers, which text does not
            run through: :mod:`lightning_gpipe.hf.composite`); default none.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokens: str,
        positions: str | None = None,
        dropout: str | None = None,
        multiplier: float | None = None,
        dropout_p: float | None = None,
        router: RouterLoss | None = None,
        extensions: Sequence[str] = (),
        per_layer: tuple[str, Sequence[str]] | None = None,
        streams: tuple[int, bool] | None = None,
        pass_tokens: bool = False,
        held: Sequence[str] = (),
        altup: str | None = None,
        pass_embeddings: bool = False,
    ) -> None:
        own = [] if per_layer is None else list(per_layer[1])
        paths = (tokens, *extensions, *own, positions, dropout, altup, *held)
        super().__init__(model, [p for p in paths if p is not None])
        self._tokens, self._positions, self._dropout = tokens, positions, dropout
        self.multiplier, self.dropout_p, self.router = multiplier, dropout_p, router
        self._extensions = tuple(extensions)
        self._per_layer_base = None if per_layer is None else per_layer[0]
        self.streams, self.pass_tokens, self._altup = streams, pass_tokens, altup
        self.pass_embeddings = pass_embeddings
        self._lent: list[str] = []
        self._per_layer_both = False  # whether get_per_layer_inputs takes the embeddings too (Gemma 4's)
        if self._per_layer_base is not None:  # the base model's own buffers its per-layer methods read (Gemma 3n's)
            base = model.get_submodule(self._per_layer_base)
            self._per_layer_both = len(inspect.signature(cast(Any, base).get_per_layer_inputs).parameters) > 1
            self._lent = [name for name, _ in base.named_buffers(recurse=False)]
            for name in self._lent:
                self.part(self._per_layer_base).register_buffer(name, base.get_buffer(name), persistent=False)

    def _per_layer_model(self) -> Any:
        """The base model that computes the per-layer inputs, given the buffers of its own this layer holds (a stage
        materialises them here, not in the base model, which it does not build)."""
        base = self.hf_model.get_submodule(cast(str, self._per_layer_base))
        holder = self.part(cast(str, self._per_layer_base))
        for name in self._lent:
            set_buffer(base, name, holder.get_buffer(name))
        return base

    def reset_parameters(self) -> None:
        """:meth:`~lightning_gpipe.hf.layer.HFLayer.reset_parameters`, then the base model's own buffers this layer
        holds recomputed as the base model initialises them (its ``_init_weights``: Gemma 3n's per-layer scales)."""
        super().reset_parameters()
        if self._lent:
            base = self._per_layer_model()
            with torch.no_grad():
                base._init_weights(base)

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, attention_mask, position_ids, *rows = value
        hidden = self.part(self._tokens)(input_ids)
        for extension in self._extensions:
            hidden = self.part(extension)(input_ids, hidden)
        per_layer = None
        if self._per_layer_base is not None:  # the base model's own methods, on the modules this layer holds
            base = self._per_layer_model()
            both = [hidden] if self._per_layer_both else []
            per_layer = base.project_per_layer_inputs(hidden, base.get_per_layer_inputs(input_ids, *both))
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        if self._positions is not None:
            hidden = hidden + self.part(self._positions)(position_ids).to(hidden.device)
        if self._dropout is not None:
            hidden = self.part(self._dropout)(hidden)
        if self.dropout_p is not None:
            hidden = nn.functional.dropout(hidden, p=self.dropout_p, training=self.training)
        if self.streams is not None:  # hyper-connections: the blocks take (N, S, streams, H) or (N, S, streams * H)
            count, flat = self.streams
            hidden = hidden.repeat(1, 1, count) if flat else hidden.unsqueeze(2).expand(-1, -1, count, -1).contiguous()
        if self._altup is not None:  # AltUp: the blocks take its stack of predictions (N, S, n, H)
            hidden = expand(cast(nn.ModuleList, self.part(self._altup)), hidden)
        statistics = None
        if self.router is not None:
            statistics = torch.zeros(input_ids.shape[0], self.router.width, device=hidden.device)
        given = input_ids if self.pass_tokens else None
        embeddings = hidden.clone() if self.pass_embeddings else None  # a copy, as the model's forward keeps them
        return _pack(hidden, attention_mask, position_ids, statistics, per_layer, given, embeddings, *rows)


class RotaryDecoderBlock(CachedDecoderBlock):
    """One block of the standard decoder layout: ``(hidden, attention_mask, position_ids[, statistics][, rows])``
    to the same, the block applied.

    Rebuilds the block's 4-D mask (by its layer type: causal or sliding-window, for the configured attention
    implementation) from the ``(N, S)`` padding mask, and the rotary cos/sin from the positions with the model's
    rotary module (for the block's layer type when the module takes one, as Gemma 3's), then calls the block as the
    model's forward does: the cache under the name the block takes (``cache``, GPT-NeoX's ``layer_past``). With router
    statistics, adds those of the block's routers (:mod:`lightning_gpipe.hf.moe`). With ``rows``, decodes
    incrementally with its own key/value cache (see :class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`). A
    block taking an argument named ``prev_...`` (:data:`~lightning_gpipe.hf.decoder_layout.CARRIED`; GLM-MoE-DSA's
    ``prev_topk_indices``) gives ``(hidden, what the next block takes there)``, as the model's forward passes it on:
    the layer carries it in the value to the next block's layer (:func:`carried_of`; the first block gets ``None``,
    as in the model's forward). A block taking the token ids gets them (:func:`tokens_of`;
    :func:`~lightning_gpipe.hf.decoder_layout.token_argument`), per-layer ones with the padding the recurrent mask
    masks replaced as the forward replaces it (:func:`~lightning_gpipe.hf.decoder_layout.padding_token`: Qwen4-Exp's
    ``ple_input_ids``); where the model's forward keeps state on its cache itself
    (:func:`~lightning_gpipe.hf.decoder_layout.cache_state`), cached decoding raises ``ValueError``.

    Args:
        model: the model.
        block: path of the block (``"model.layers.2"``).
        rotary: path of the rotary embedding the block's layer calls (``"model.rotary_emb"``; Granite-SWA's
            ``"model.rotary_embs.1"``, the one of its layer's ``rope_theta``); held by every block layer (its
            buffers are not saved, so no name is added to the checkpoint). ``None`` for a model without one, or a
            block the forward gives none (its blocks get no ``position_embeddings``).
        layer_index: the index in the model of the block's first attention layer (which mask it uses, its cache's
            layer: ``i * k`` for blocks of ``k`` attention sublayers, LongCat-Flash's two).
        router: see :class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`.
        held: paths of other modules the layer holds without calling them (rotary modules the model builds and its
            forward leaves unused: Granite-SWA's ``model.rotary_emb``); default none.
        altup: the hidden states are AltUp's stack of predictions (:mod:`lightning_gpipe.hf.altup`), ``(N, S, n, H)``
            between layers, which the block takes and gives as ``(n, N, S, H)``; default ``False``. Kept as
            :attr:`stacked` (the self-check compares what the block receives in the travelling layout).

    Layers reusing the keys and values of earlier ones (``config.kv_sharing_modes``: Gemma 3n's and Gemma 4's last
    ``num_kv_shared_layers``): the block of a layer that stores them for later ones (``"store"``) adds them to the
    value, ``(N, 2, kv heads, S, head width)``, after what it carries otherwise; every later block's layer gives its
    block those of the blocks before it by layer type (``shared_kv_states``), as the model's forward does, so a layer
    reads keys and values across a stage boundary, their gradients sent back. In cached decoding a reusing layer keeps
    the new tokens' keys and values in its own cache under the storing layer's index, so that it builds its mask
    against what the storing layer's cache holds, as the model's forward builds one mask per layer type.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        block: str,
        rotary: str | None,
        layer_index: int,
        router: RouterLoss | None = None,
        held: Sequence[str] = (),
        altup: bool = False,
    ) -> None:
        paths = [block, *([] if rotary is None else [rotary]), *(p for p in held if p != rotary)]
        super().__init__(model, paths, layer_index, router)
        self._block, self._rotary = block, rotary
        typed = rotary is not None and "layer_type" in inspect.signature(self.part(rotary).forward).parameters
        self._rotary_type = (self.layer_type,) if typed else ()
        self._routers = [] if router is None else router.routers(self.part(block), block)
        arguments = inspect.signature(self.part(block).forward).parameters
        self._cache_argument = "layer_past" if "layer_past" in arguments and "cache" not in arguments else "cache"
        self._carry = next((name for name in arguments if name.startswith(CARRIED)), None)
        self._block_index = int(block.rsplit(".", 1)[1])
        self._second_mask = next((n for n in arguments if n.endswith("_mask") and n != "attention_mask"), None)
        self._per_layer, self._shared_kv = "per_layer_input" in arguments, "shared_kv_states" in arguments
        self.stacked = altup
        self._kv_sharing(model.config, layer_index)
        self._computed = computed_arguments(self.part(block))
        base = model.get_submodule(block.rsplit(".", 2)[0])
        self._token_argument = token_argument(base, self.part(block))  # DeepSeek-V4's input_ids...
        self.tokens = self._token_argument is not None
        self._padding_token = None if self._token_argument == "input_ids" else padding_token(base)
        kept = cache_state(base)  # state of the whole model's cache: cached decoding refused (forward)
        self._cache_refusal = None if not kept else (
            f"{type(base).__name__}'s forward keeps state on its cache itself ({', '.join(kept)}), which no block's"
            " own cache keeps: cached decoding through the pipeline cannot follow it; decode with `kv_cache=False` or"
            " the model's own `generate`."
        )  # fmt: skip
        mixed = mixed_masks(model.config)
        if self._second_mask is not None and self._recurrent_mask is None and mixed is not None:
            self._mask, self._recurrent_mask = MASKS[mixed[0]], MASKS[mixed[1]]  # both masks, as a hybrid block's
        rope = getattr(model.config, "rope_parameters", None)
        self._kinds = rotary_kinds(model.config) if typed else []
        rotated = rotary_layer_types(type(base))
        self._nope = (
            bool(typed) and isinstance(rope, dict) and self.layer_type in rope and rope[self.layer_type] is None
        ) or (rotated is not None and self.layer_type not in rotated)  # Lara-mini's forward gives its full layers none

    def _kv_sharing(self, config: Any, layer_index: int) -> None:
        """Whether the block's layer stores keys and values for later layers or reuses them, its layer type, those
        of the storing layers before it, and the cache layer its mask is built against (see the class)."""
        modes = (getattr(config, "kv_sharing_modes", None) if self._shared_kv else None) or []
        mode = modes[layer_index] if modes else None
        stores = [j for j, kind in enumerate(modes[:layer_index]) if kind == "store"]
        self._stores, self._reuses, self._kv_type = mode == "store", mode == "reuse", layer_type(config, layer_index)
        self._stored_before = [layer_type(config, j) for j in stores]
        if self._reuses:  # its mask is the storing layer's of its type
            self.mask_layer = max(j for j in stores if layer_type(config, j) == self._kv_type)

    def _shared_after(self, value: tuple[Tensor, ...], stored: dict, cache: Any, new: int) -> list[Tensor]:
        """The keys and values the value carries after the block (``stored``: the store it was given), with its
        own where it stores them; in cached decoding a reusing layer's cache takes the ``new`` tokens' of the storing
        layer (see the class)."""
        shared = shared_of(value)
        if self._stores:
            shared.append(torch.stack(stored[self._kv_type], dim=1))
        if cache is not None and self._reuses:
            cache.update(*(states[:, :, -new:] for states in stored[self._kv_type]), self.mask_layer)
        return shared

    def _arguments(self, value: tuple[Tensor, ...], hidden: Tensor, position_ids: Tensor, mask: Any) -> dict:
        """What the model's forward gives the block besides the hidden states, the cache and the positions."""
        arguments: dict[str, Any] = {"attention_mask": mask}
        if self._nope:  # a layer type without rotary parameters: none, and what the model computes instead
            arguments["position_embeddings"] = None
        elif self._kinds:  # a table per kind the config names, all for every block (DeepSeek-V4's main, compress)
            rotary = self.part(cast(str, self._rotary))
            arguments["position_embeddings"] = {kind: rotary(hidden, position_ids, kind) for kind in self._kinds}
        elif self._rotary is not None:
            arguments["position_embeddings"] = self.part(self._rotary)(hidden, position_ids, *self._rotary_type)
        if self.tokens:  # the token ids; per-layer ones with the padding the recurrent mask masks replaced
            tokens, recurrent = tokens_of(value, self.router), mask[1] if isinstance(mask, tuple) else None
            if self._padding_token is not None and recurrent is not None:
                tokens = torch.where(recurrent.bool(), tokens, self._padding_token)
            arguments[cast(str, self._token_argument)] = tokens
        for name, compute in self._computed.items():
            arguments[name] = compute(position_ids) if self._nope else None
        if self._carry is not None:
            arguments[self._carry] = carried_of(value)
        if self._per_layer:  # Gemma 4: its own slice of the per-layer inputs, None where the model computes none
            per_layer = carried_of(value, 4)
            arguments["per_layer_input"] = None if per_layer is None else per_layer[:, :, self._block_index, :]
        if self._shared_kv:  # the keys and values stored by the blocks before, by layer type (see the class)
            stored = zip(self._stored_before, shared_of(value))
            arguments["shared_kv_states"] = {kind: (pair[:, 0], pair[:, 1]) for kind, pair in stored}
        if isinstance(mask, tuple):  # a hybrid layer type: the recurrent mask under the block's other mask argument
            arguments["attention_mask"], arguments[cast(str, self._second_mask)] = mask
        return arguments

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, statistics, documents, rows = _unpack(value, self.router, self.tokens)
        if rows is not None and self._cache_refusal is not None:
            raise ValueError(self._cache_refusal)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows, documents)
        arguments = self._arguments(value, hidden, position_ids, mask)
        # statistics come with a router only (_unpack)
        recording: AbstractContextManager[list[Tensor]] = (
            cast(RouterLoss, self.router).recording(self._routers) if statistics is not None else nullcontext([])
        )
        with recording as router_logits:
            output = self.part(self._block)(
                to_block(hidden) if self.stacked else hidden,
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_argument: cache},
                **arguments,
            )
        given = None
        if self._carry is not None:  # the block gives (hidden, what the next block takes)
            output, given = output
        output = from_block(output) if self.stacked else output
        shared = self._shared_after(value, arguments.get("shared_kv_states", {}), cache, hidden.shape[1])
        for logits in router_logits:
            assert self.router is not None  # router logits are recorded with a router only
            statistics = statistics + self.router.statistics(logits, attention_mask[:, -hidden.shape[1] :])
        per_layer, tokens = carried_of(value, 4), tokens_of(value, self.router) if self.tokens else None
        return _pack(
            output, attention_mask, position_ids, statistics, per_layer, tokens, given, *shared, documents, rows
        )


class SkippedBlock(HFLayer):
    """A block the model's forward skips on text alone (Mllama's cross-attention layers without an image,
    :func:`~lightning_gpipe.hf.decoder_layout.skipped_block`): it holds the block's modules (every tensor of the model
    is held by a layer; neither gets a gradient) and passes the value on unchanged.

    Args:
        model: the model.
        block: path of the block (``"model.layers.3"``).
    """

    tokens = False  # it reads no token ids (see RotaryDecoderBlock.tokens)

    def __init__(self, model: PreTrainedModel, block: str) -> None:
        super().__init__(model, [block])

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return value


class GPT2Block(CachedDecoderBlock):
    """One GPT-2 block: ``(hidden, attention_mask, position_ids[, rows])`` to the same, with the causal mask
    rebuilt; with ``rows``, decodes incrementally with its own key/value cache (see
    :class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`).

    Args:
        model: the model.
        block: path of the block (``"transformer.h.2"``).
        layer_index: the block's index in the model; default: the number in ``block``'s path.
    """

    def __init__(self, model: PreTrainedModel, block: str, layer_index: int | None = None) -> None:
        super().__init__(model, [block], int(block.rsplit(".", 1)[1]) if layer_index is None else layer_index)
        self._block = block

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, _, documents, rows = _unpack(value, None)
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows, documents)
        hidden = self.part(self._block)(
            hidden, cache, mask, None, use_cache=cache is not None, position_ids=position_ids
        )
        return _pack(hidden, attention_mask, position_ids, documents, rows)


EMBEDDINGS = "original_hidden_states"
"""The block argument that takes the embeddings (the embedding layer's output, carried beside the hidden states from
layer to layer: Zamba's and Zamba2's, whose shared attention block concatenates them to its input)."""

CAUSAL_MASK = "causal_mask"
"""The mask argument of a hybrid block that takes the causal (attention) mask beside ``attention_mask``, which then
takes the recurrent one (Zamba's blocks, given both as the model's forward gives them)."""


class GPT2LikeBlock(CachedDecoderBlock):
    """One block of the GPT-2-like layout: ``(hidden, attention_mask, position_ids[, rows])`` to the same, the block
    applied.

    Rebuilds the causal 4-D mask from the ``(N, S)`` padding mask (boolean for MPT, whose attention fills where it is
    true), and gives the block what the model's forward gives it where it asks for it: ALiBi biases from the whole
    mask ``(N, past + S)`` with the base model's ``build_alibi_tensor`` (Bloom's ``alibi``, ``(N * heads, 1, past +
    S)``; ``None`` for Falcon's rotary layout; with Falcon's ``alibi=True``, its forward's biases folded into the mask,
    :meth:`_folded_alibi`), MPT's ``position_bias`` (``build_mpt_alibi_tensor`` over
    ``config.max_seq_len``), the rotary cos/sin from the positions (Falcon; LFM3's of the block's layer type, none
    for a layer type without a table of its rotary embedding's ``layer_types``), the cache under the name it takes (and
    ``use_cache`` where it names it: a Mamba block passes its other arguments on to its mixer), its index in the model
    (``layer_idx``) and the embeddings the value carries beside the hidden states (``original_hidden_states``, which
    it passes on: Zamba's and Zamba2's blocks, whose shared attention block reads them at every hybrid layer and picks
    Zamba2's per-layer adapters by the index). A hybrid block taking a ``causal_mask`` (Zamba's) gets the causal mask
    there and the recurrent one as ``attention_mask``, as the model's forward gives them. With ``rows``, decodes
    incrementally with its own cache (keys and values, a recurrent layer's states:
    :class:`~lightning_gpipe.hf.kv_cache.CachedDecoderBlock`). A block whose modules keep its recurrent state on
    themselves (RecurrentGemma's recurrent blocks, whose modules set it up with ``_setup_cache``) is told
    ``use_cache=False`` in training, so it starts fresh per sequence; in cached decoding it is given the state of its
    rows (:meth:`_states_of`).

    Args:
        model: the model.
        block: path of the block (``"transformer.h.2"``).
        rotary: path of the rotary embedding (``"transformer.rotary_emb"``), or ``None`` (default).
        mask: the helper that rebuilds the block's mask instead of its layer type's
            (:data:`~lightning_gpipe.hf.masks.MASKS`; OpenAI GPT's :func:`~lightning_gpipe.hf.masks.padding_mask`),
            or ``None`` (default).

    Raises:
        ValueError: (forward, with ``rows``) for a block that keeps its recurrent state in an argument of its own
            (RWKV's ``state``), which no cache of its rows would keep, or that takes no cache (OpenAI GPT's).
    """

    def __init__(
        self, model: PreTrainedModel, block: str, rotary: str | None = None, mask: Callable[..., Any] | None = None
    ) -> None:
        super().__init__(model, [block, *([] if rotary is None else [rotary])], int(block.rsplit(".", 1)[1]))
        self._block, self._rotary = block, rotary
        if mask is not None:
            self._mask = mask
        self._base = block.rsplit(".", 2)[0]
        parameters = inspect.signature(self.part(block).forward).parameters
        self._arguments = set(parameters)
        self._keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self._cache_name = next((n for n in ("layer_past", "cache") if n in self._arguments), None)
        stateful = {type(m).__name__ for m in self.part(block).modules() if callable(getattr(m, "_setup_cache", None))}
        self._state_on_modules = sorted(stateful)  # RecurrentGemma's recurrent blocks: see _states_of
        self._rescale_every = getattr(model.config, "rescale_every", 0) or 0  # RWKV's (see _rescaled)
        embedding = None if rotary is None else self.part(rotary)
        typed = embedding is not None and "layer_type" in inspect.signature(embedding.forward).parameters
        kinds = getattr(embedding, "layer_types", ()) if typed else ()  # LFM3's tables, one per layer type
        self._rotary_type = (self.layer_type,) if typed else ()
        self._unrotated = typed and self.layer_type not in kinds
        base = model.get_submodule(self._base)
        own = callable(getattr(base, "build_alibi_tensor", None))  # Bloom's; else its modeling module's (Falcon's)
        self._folds_alibi = "alibi" in self._arguments and not own and bool(getattr(model.config, "alibi", False))
        self._mask_keys = mask_keys(type(base))  # Zaya's: a hybrid type's two masks in one dict
        others = (n for n in self._arguments if n.endswith("_mask") and not n.startswith(("attention", "encoder")))
        self._other_mask = next(others, None)  # a hybrid block's second mask argument (see _extra)
        named = inspect.unwrap(type(base).forward).__code__.co_varnames  # a value its forward carries between blocks
        self._carry = next((n for n in self._arguments if n.startswith(CARRIED) and n in named), None)
        if self._folds_alibi:  # always a 4-D mask to fold the biases into, as the model's forward builds it
            self._mask = partial(self._mask, allow_is_causal_skip=False)

    def reset_parameters(self) -> None:
        """:meth:`~lightning_gpipe.hf.layer.HFLayer.reset_parameters`, then, where the block holds buffers it does not
        save, the model's initialisation of its base model run on this block alone (a shallow copy of the base model
        holding only it, and its own buffers on the meta device, which its initialisation may set but this layer does
        not hold: RecurrentGemma's ``normalizer``): a base model may set its blocks' buffers itself (Falcon-H1's
        ``mup_vector`` of each mixer), which a stage building only its own blocks would otherwise leave unset."""
        super().reset_parameters()
        block = self.part(self._block)
        if not any(name not in module.state_dict() for module in block.modules() for name, _ in
                   module.named_buffers(recurse=False)):  # fmt: skip
            return
        base = self.hf_model.get_submodule(self._base)
        blocks = self._block.rsplit(".", 2)[1]
        alone = copy.copy(base)  # the base model's attributes, but its children only this block, in its list
        own = {name: buffer.to("meta") for name, buffer in base.named_buffers(recurse=False)}
        alone.__dict__.update(_modules={blocks: nn.ModuleList([block])}, _parameters={}, _buffers=own)
        with torch.no_grad():
            self.hf_model._init_weights(alone)

    def _folded_alibi(self, base: Any, attention_mask: Tensor, hidden: Tensor, mask: Any) -> dict[str, Any]:
        """Falcon's ALiBi with ``alibi=True``, as its forward computes it: the biases ``(N, heads, 1, past + S)`` of
        the whole padding mask, by its modeling module's ``build_alibi_tensor``, folded into the 4-D mask (scaled by
        ``1 / sqrt(head width)``, the dtype's minimum where the mask masks), both given to the block."""
        alibi = sys.modules[type(base).__module__].build_alibi_tensor(attention_mask, base.num_heads, hidden.dtype)
        if mask is None or mask.ndim != 4:
            return {"alibi": alibi, "attention_mask": mask}
        minimum = torch.finfo(hidden.dtype).min
        if mask.dtype == torch.bool:
            mask = torch.where(mask, torch.full((), 0.0, device=mask.device, dtype=hidden.dtype), minimum)
        alibi = alibi.reshape(hidden.shape[0], -1, *alibi.shape[1:])
        scaled = alibi / math.sqrt(self.config.hidden_size // base.num_heads)
        return {"alibi": alibi, "attention_mask": torch.masked_fill(scaled, mask < -1, minimum)}

    def _extra(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor, mask: Any) -> dict[str, Any]:
        """The block's arguments besides the hidden states and the cache (see the class docstring)."""
        base = cast(Any, self.hf_model.get_submodule(self._base))
        arguments: dict[str, Any] = {"attention_mask": mask}
        if isinstance(mask, tuple) and self._mask_keys is not None:  # both in one dict, under the forward's keys
            arguments["attention_mask"] = dict(zip(self._mask_keys, mask, strict=True))
        elif isinstance(mask, tuple):  # a hybrid layer type: the recurrent mask under the block's other mask argument
            name = cast(str, self._other_mask)  # Zamba's causal_mask takes the causal one, attention_mask the other
            arguments["attention_mask"], arguments[name] = mask[::-1] if name == CAUSAL_MASK else mask
        if "layer_idx" in self._arguments:
            arguments["layer_idx"] = self.layer_index
        if self._folds_alibi:
            arguments.update(self._folded_alibi(base, attention_mask, hidden, mask))
        elif "alibi" in self._arguments:
            build = getattr(base, "build_alibi_tensor", None)
            arguments["alibi"] = None if build is None else build(attention_mask, base.num_heads, hidden.dtype)
        if "position_bias" in self._arguments:
            length = self.config.max_seq_len
            arguments["position_bias"] = base.build_mpt_alibi_tensor(base.num_heads, length, device=hidden.device)
            arguments["attention_mask"] = mask.to(torch.bool)
        if self._unrotated:  # a layer type without a table of its own (LFM3's convolutions): none, as the forward
            arguments["position_embeddings"] = None
        elif self._rotary is not None:
            arguments["position_embeddings"] = self.part(self._rotary)(hidden, position_ids, *self._rotary_type)
        if "position_ids" in self._arguments:
            arguments["position_ids"] = position_ids
        return arguments

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, _, documents, rows = _unpack(value, None)
        name = self._cache_name
        if rows is not None and name is None:
            state = sorted(self._arguments & {"state"})
            raise ValueError(
                f"{type(self.part(self._block)).__name__}"
                + (
                    f" keeps its recurrent state in an argument of its own ({state}), not in a cache: cached decoding"
                    " through the pipeline does not keep it; decode with the model's own `generate`."
                    if state
                    else " takes no cache (the model's `generate` runs the whole sequence every step): decode"
                    " through the pipeline with kv_cache=False."
                )
            )
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows, documents)
        given = {"use_cache": cache is not None} if "use_cache" in self._arguments else {}  # as the forward gives it
        extra = self._extra(hidden, attention_mask, position_ids, mask)
        embeddings = carried_of(value)  # carried on past blocks that do not read them
        if embeddings is not None and EMBEDDINGS in self._arguments:
            extra[EMBEDDINGS] = embeddings
        if not self._keywords:  # a block naming its arguments (RWKV's takes no mask): only those
            extra = {key: item for key, item in extra.items() if key in self._arguments}
        if self._carry is not None:  # what the previous block gave (None for the first, as in the forward)
            extra[self._carry] = carried_of(value)
        with self._states_of(rows):
            output = self.part(self._block)(hidden, **given, **({} if name is None else {name: cache}), **extra)
        carried = None
        if self._carry is not None:  # the block gives (hidden, what the next block takes)
            output, carried = output
        output = output[0] if isinstance(output, (tuple, list)) else output  # OpenAI GPT's blocks give a list
        passed = carried if self._carry is not None else embeddings  # one carried slot: a block's output, or these
        return _pack(self._rescaled(output), attention_mask, position_ids, passed, documents, rows)

    @contextmanager
    def _states_of(self, rows: Tensor | None) -> Iterator[None]:
        """In cached decoding (``rows``), a block keeping its recurrent state on its modules
        (:attr:`_state_on_modules`: RecurrentGemma's convolution and recurrent states, tensors its modules hold as
        plain attributes) given the state of these rows, kept in ``module_states`` between steps: ``None`` for
        rows new to it, from which its modules start at zero as the model's ``_setup_cache`` starts them. A stage runs
        every micro-batch of a step through the same modules; each keeps its own rows' state."""
        if rows is None or not self._state_on_modules:
            yield
            return
        key, modules = tuple(rows.tolist()), list(self.part(self._block).modules())
        saved = self.module_states.get(key, {})
        for index, name in _plain_tensors(modules).keys() | saved.keys():
            setattr(modules[index], name, saved.get((index, name)))
        yield
        self.module_states[key] = _plain_tensors(modules)

    def _rescaled(self, hidden: Tensor) -> Tensor:
        """``hidden`` halved where the model's forward halves it: after every ``config.rescale_every``-th block while
        its base model's weights are rescaled for evaluation (RWKV's ``layers_are_rescaled``, set by its own forward
        in evaluation mode, which divides the blocks' output weights by powers of 2)."""
        every = self._rescale_every
        if not every or (self.layer_index + 1) % every:
            return hidden
        rescaled = getattr(self.hf_model.get_submodule(self._base), "layers_are_rescaled", False)  # per mode
        return hidden / 2 if rescaled else hidden


def _plain_tensors(modules: list[nn.Module]) -> dict[tuple[int, str], Tensor]:
    """The tensors ``modules`` hold as plain attributes (no parameters, no buffers), by ``(index in modules,
    name)``: a state a module keeps on itself (RecurrentGemma's ``conv1d_state``, ``recurrent_states``)."""
    return {
        (index, name): item
        for index, module in enumerate(modules)
        for name, item in vars(module).items()
        if isinstance(item, Tensor)
    }


class FinalNorm(HFLayer):
    """The final norm: ``(hidden, ...)`` to the normalised hidden states ``(N, S, H)``, or ``(hidden,
    statistics)`` when the value carries router statistics (the head needs nothing else).

    Args:
        model: the model.
        norm: path of the norm (``"model.norm"``), or ``None`` for a model without one (OpenAI GPT's blocks end
            in their own norms): the hidden states as the last block gives them.
        router: the model's :class:`~lightning_gpipe.hf.moe.RouterLoss` when the value carries router statistics,
            else ``None`` (default).
        divisor: what the normalised hidden states are divided by before the head (MiniCPM3's
            ``config.logits_scaling``, ``hidden_size / dim_model_base``), or ``None`` (default).
        collapse: path of a module the model's forward applies before the norm (HY-V4's ``"model.hc_head"``, which
            collapses the hyper-connection streams, see :class:`~lightning_gpipe.hf.decoder_cut.DecoderCut`), or
            ``None`` (default).
        altup: path of the modules that narrow AltUp's stack of predictions before the norm (Gemma 3n's
            ``"model.altup_unembed_projections"``, :func:`~lightning_gpipe.hf.altup.collapse`), or ``None``
            (default).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        norm: str | None,
        router: RouterLoss | None = None,
        divisor: float | None = None,
        collapse: str | None = None,
        altup: str | None = None,
    ) -> None:
        super().__init__(model, [path for path in (collapse, altup, norm) if path is not None])
        self._norm, self.router, self.divisor, self._collapse, self._altup = norm, router, divisor, collapse, altup

    def forward(self, value: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, _, _, statistics, _, _ = _unpack(value, self.router)
        if self._collapse is not None:
            hidden = self.part(self._collapse)(hidden)
        if self._altup is not None:
            hidden = collapse(cast(nn.ModuleList, self.part(self._altup)), hidden)
        if self._norm is not None:
            hidden = self.part(self._norm)(hidden)
        if self.divisor is not None:
            hidden = hidden / self.divisor
        return hidden if statistics is None else (hidden, statistics)


class Head(HFLayer):
    """A causal LM's output head: the final norm's hidden states ``(N, S, H)`` to logits ``(N, S, V)`` (or
    ``(hidden, statistics)`` to ``(logits, statistics)``), scaled as the model's forward scales them.

    Args:
        model: the model.
        head: path of the head (``"lm_head"``).
        multiplier: a factor on the logits (Cohere's ``config.logit_scale``), or ``None``.
        divisor: what the logits are divided by (Granite's ``config.logits_scaling``), or ``None``.
        softcap: ``c`` of the soft-capping ``c * tanh(logits / c)`` (Gemma 2's ``config.final_logit_softcapping``),
            or ``None``.
        vocab: how many of the head's outputs are logits (Inkling's ``config.unpadded_vocab_size``, the rest
            padding), or ``None`` (default: all).
        before: paths of modules applied to the hidden states before the head, in order (a decoder stack's end,
            :class:`~lightning_gpipe.hf.decoder_stack.StackHead`); none by default.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        head: str,
        multiplier: float | None = None,
        divisor: float | None = None,
        softcap: float | None = None,
        vocab: int | None = None,
        before: Sequence[str] = (),
    ) -> None:
        super().__init__(model, [*before, head])
        self._head, self._before = head, tuple(before)
        self.multiplier, self.divisor, self.softcap, self.vocab = multiplier, divisor, softcap, vocab

    def forward(self, value: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        hidden, *statistics = value if isinstance(value, tuple) else (value,)
        for path in self._before:
            hidden = self.part(path)(hidden)
        logits = self.part(self._head)(hidden)
        if self.vocab is not None:
            logits = logits[..., : self.vocab]
        if self.multiplier is not None:
            logits = logits * self.multiplier
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return (logits, *statistics) if statistics else logits
