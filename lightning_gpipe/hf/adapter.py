"""A loaded Hugging Face ``transformers`` model as the backbone contract: one ``nn.Sequential`` of tensor-only layers.

:func:`to_sequential` returns embeddings -> one layer per decoder (or encoder) block -> final norm -> head. The
layers hold the model's own modules (no weight is copied): each layer holds its modules under their paths in the
model, so a layer's state-dict names are the model's (``backbone.3.model.layers.2.mlp.up_proj.weight`` is
``model.layers.2.mlp.up_proj.weight`` of the model, behind the layer's ``backbone.3.`` prefix), and a parameter the
model ties (input embedding and output projection) is one ``nn.Parameter`` in two layers, which the strategy's tie
mechanism (:mod:`lightning_gpipe.engine.ties`) finds by itself.

Between layers only tensors travel, each with the batch in dim 0: the hidden states, the ``(N, S)`` padding mask and
(decoders) the ``(N, S)`` position ids. Each block rebuilds what the model's own ``forward`` builds once for all
blocks, with the same helpers of ``transformers.masking_utils``: the 4-D attention mask for the configured attention
implementation (``eager``, ``sdpa``...) and, for rotary models, the cos/sin tables from the positions; so no
``(N, 1, S, S)`` mask or rotary table is ever sent between stages, and the blocks are called exactly as the model's
forward calls them, with ``use_cache=False``.

A family (an architecture) is a :class:`Family`: which model classes it takes and how it cuts them into layers.
Built in: the Llama family (``llama``, ``mistral``, ``qwen2``: one block signature), GPT-2 and BERT (masked LM and
sequence classification). :func:`register_family` adds one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

try:
    from transformers import DynamicCache, PreTrainedModel
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_causal_mask,
        create_sliding_window_causal_mask,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5 or newer (its masking_utils): pip install 'transformers>=5'"
    ) from error


class UnsupportedModelError(TypeError):
    """A model whose class no registered :class:`Family` takes; the message names the class and the families."""


class _Path(nn.Module):
    """An empty container standing for one component of a module path (``model`` in ``model.layers.2``)."""


class HFLayer(nn.Module):
    """One backbone layer: some of a Hugging Face model's modules, held under their paths in the model.

    Subclasses implement ``forward`` on tensors only. The model itself is kept as a plain attribute (not a
    submodule), so the layer's state-dict names are exactly the model's names of the modules it holds.

    Args:
        model: the ``PreTrainedModel`` the modules belong to.
        paths: the dotted paths of the modules in ``model`` (``"model.layers.2"``), all registered in this layer.

    Attributes:
        hf_model: the whole model (not registered: its parameters are not this layer's).
        paths: the paths given.
        weights: where :meth:`reset_parameters` reads this layer's tensors from (a
            :class:`~lightning_gpipe.hf.weights.SafetensorsWeights`), or ``None`` to initialise them as the model
            initialises new weights (its ``_init_weights``).
    """

    def __init__(self, model: PreTrainedModel, paths: Sequence[str]) -> None:
        super().__init__()
        self.__dict__["hf_model"] = model
        self.__dict__["_skipped_resets"] = []
        self.paths = tuple(paths)
        self.weights = None
        for path in self.paths:
            _attach(self, path, model.get_submodule(path))

    @property
    def weights(self) -> Optional[Any]:
        """Where :meth:`reset_parameters` reads this layer's tensors from, or ``None`` (see the class)."""
        return self.__dict__.get("_weights")

    @weights.setter
    def weights(self, weights: Optional[Any]) -> None:
        # with weights, the inner modules whose tensors all come from the checkpoint skip their own reset when
        # materialised (children are reset before this layer): a random init of tensors about to be replaced would
        # make the whole layer resident once more, and cost its time; this layer's reset_parameters undoes it
        self.__dict__["_weights"] = weights
        self._restore_resets()
        if weights is None:
            return
        persistent = {id(t) for t in self.state_dict(keep_vars=True).values()}
        for module in self.modules():
            tensors = [*module.parameters(), *module.buffers()]
            if module is self or not tensors or not all(id(t) in persistent for t in tensors):
                continue
            for name in ("reset_parameters", "_reset_parameters"):
                if hasattr(type(module), name):
                    module.__dict__[name] = _loaded_from_checkpoint
                    self._skipped_resets.append((module, name))

    def _restore_resets(self) -> None:
        for module, name in self.__dict__["_skipped_resets"]:
            module.__dict__.pop(name, None)
        self._skipped_resets.clear()

    @property
    def config(self) -> Any:
        """The model's configuration."""
        return self.hf_model.config

    def part(self, path: str) -> nn.Module:
        """The module held under ``path``."""
        return self.get_submodule(path)

    def reset_parameters(self) -> None:
        """Give this layer's parameters and buffers their values, in place: the tensors of :attr:`weights` (a
        checkpoint's, read for this layer's names only), else the model's own initialisation of new weights.

        Called by :func:`lightning_gpipe.engine.partition.materialize` for a model built on the meta device (each stage
        initialises or loads only its own layers). Buffers that no checkpoint holds (rotary frequencies, BERT's
        position ids) are recomputed by the model's ``_init_weights``.

        Raises:
            KeyError: if :attr:`weights` lacks a name of this layer (naming it and the checkpoint).
        """
        persistent = self.state_dict(keep_vars=True)
        for module in _post_order(self):
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if self.weights is not None and all(any(t is p for p in persistent.values()) for t in own):
                continue  # everything of it comes from the checkpoint
            for tensor in [module, *own]:
                if getattr(tensor, "_is_hf_initialized", False):
                    tensor._is_hf_initialized = False
            with torch.no_grad():
                self.hf_model._init_weights(module)
        if self.weights is not None:
            device = _device_of(persistent.values())
            for tensor in persistent.values():  # free this layer's memory first: a stage peaks at its own size
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=device)
            for name, tensor in persistent.items():
                if tensor.numel() == 0:  # a name sharing a tensor already read is skipped
                    tensor.data = self.weights.load([name], device=device)[name].to(tensor.dtype)
        self._restore_resets()  # the model's modules as they were


def _loaded_from_checkpoint() -> None:
    """Stands for the ``reset_parameters`` of a module whose tensors its :class:`HFLayer` reads from a checkpoint."""


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = _Path()
            node.add_module(name, child)
        node = child
    node.add_module(last, module)


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Each submodule once, children before their parents (as ``nn.Module.apply`` and the model's init go)."""
    seen: set[int] = set()

    def visit(node: nn.Module) -> Iterator[nn.Module]:
        for child in node.children():
            if id(child) not in seen:
                yield from visit(child)
        if id(node) not in seen:
            seen.add(id(node))
            yield node

    yield from visit(module)


def _device_of(tensors: Any) -> torch.device:
    return next((t.device for t in tensors), torch.device("cpu"))


# --------------------------------------------------------------------------- decoders: the Llama family, GPT-2


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids ``(N, S)`` long of a padded batch: each row counts its real tokens from 0 (padding gets 0).

    As ``generate`` numbers left-padded prompts; for right padding or none it equals ``arange(S)`` on the real
    tokens, as the model's ``forward`` numbers them when given no positions.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0).masked_fill(attention_mask == 0, 0)


class DecoderEmbedding(HFLayer):
    """Token (and learned position) embeddings of a decoder: ``(input_ids, attention_mask, position_ids)``, each
    ``(N, S)`` long, to ``(hidden (N, S, H), attention_mask, position_ids)``; a fourth item (the ``rows`` of cached
    decoding, see :class:`CachedDecoderBlock`) is passed on.

    Args:
        model: the model.
        tokens: path of the token embedding (``"model.embed_tokens"``).
        positions: path of a learned position embedding (GPT-2's ``"transformer.wpe"``), or ``None`` (rotary).
        dropout: path of the dropout after the embeddings, or ``None``.
    """

    def __init__(
        self, model: PreTrainedModel, tokens: str, positions: Optional[str] = None, dropout: Optional[str] = None
    ) -> None:
        super().__init__(model, [p for p in (tokens, positions, dropout) if p is not None])
        self._tokens, self._positions, self._dropout = tokens, positions, dropout

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        input_ids, attention_mask, position_ids, *rows = value
        hidden = self.part(self._tokens)(input_ids)
        if self._positions is not None:
            hidden = hidden + self.part(self._positions)(position_ids).to(hidden.device)
        if self._dropout is not None:
            hidden = self.part(self._dropout)(hidden)
        return (hidden, attention_mask, position_ids, *rows)


def _decoder_mask(config: Any, layer_index: int) -> Callable[..., Any]:
    """The mask helper the model's forward uses for block ``layer_index``: by ``config.layer_types`` (Qwen2, ...),
    else sliding-window when ``config.sliding_window`` is set (Mistral), else causal."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return (
            create_sliding_window_causal_mask if layer_types[layer_index] == "sliding_attention" else create_causal_mask
        )
    return create_sliding_window_causal_mask if getattr(config, "sliding_window", None) else create_causal_mask


class CachedDecoderBlock(HFLayer):
    """A decoder block that can keep its own key/value cache for incremental decoding.

    In training and plain evaluation the value is ``(hidden (N, S, H), attention_mask (N, S), position_ids (N,
    S))`` and the block runs without a cache (``use_cache=False``). For cached decoding (see
    :func:`~lightning_gpipe.hf.greedy_generate`) the value carries a fourth item, ``rows`` ``(n,)`` long: which
    sequences of the batch these are. ``hidden`` and ``position_ids`` are then only the new tokens ``(n, t)``,
    while ``attention_mask`` ``(n, past + t)`` covers every token so far; the block keeps one
    ``transformers.DynamicCache`` per set of rows (one per micro-batch: a pipeline splits every decoding step of a
    batch alike), in which the model's attention appends the new keys and values, and builds the 4-D mask against
    it as the model's forward does. So only the new tokens' hidden states travel between stages, and each stage
    holds the caches of its own blocks only. :func:`clear_kv_caches` empties them.

    Args:
        model: the model.
        paths: the paths of the modules it holds (the block first).
        layer_index: the block's index in the model (its attention's ``layer_idx``, which mask it uses).

    Attributes:
        kv_cache: ``{rows: DynamicCache}``, the caches of cached decoding (not part of the state dict).
    """

    def __init__(self, model: PreTrainedModel, paths: Sequence[str], layer_index: int) -> None:
        super().__init__(model, paths)
        self.layer_index = layer_index
        self._mask = _decoder_mask(model.config, layer_index)
        self.kv_cache: dict[tuple[int, ...], Any] = {}

    def cache_and_mask(self, hidden: Tensor, attention_mask: Tensor, position_ids: Tensor, rows: Optional[Tensor]):
        """The cache of ``rows`` (``None`` without rows) and the block's 4-D mask against it.

        Raises:
            RuntimeError: if ``attention_mask`` covers earlier tokens whose keys and values this block has not
                cached for these rows (caches cleared or the batch split differently mid-decoding).
        """
        cache = None
        if rows is not None:
            key = tuple(rows.tolist())
            past = attention_mask.shape[1] - hidden.shape[1]
            cache = self.kv_cache.get(key)
            if cache is None and past == 0:
                cache = self.kv_cache[key] = DynamicCache(config=self.config)
            seen = None if cache is None else cache.get_seq_length(self.layer_index)
            if seen != past:
                raise RuntimeError(
                    f"Block {self.layer_index} holds {seen or 0} cached positions for rows {list(key)} but the"
                    f" attention mask says {past} came before: start cached decoding with the whole prompts, feed"
                    " each later step the new tokens of the same rows (every step split alike), and call"
                    " `clear_kv_caches(backbone)` between generations."
                )
        mask = self._mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=cache,
            position_ids=position_ids,
            layer_idx=self.layer_index,
        )
        return cache, mask


def clear_kv_caches(backbone: nn.Module) -> None:
    """Empty the key/value caches of ``backbone``'s decoder blocks (those this process holds), freeing them."""
    for module in backbone.modules():
        if isinstance(module, CachedDecoderBlock):
            module.kv_cache = {}


class RotaryDecoderBlock(CachedDecoderBlock):
    """One block of the Llama family: ``(hidden, attention_mask, position_ids[, rows])`` to the same, the block
    applied.

    Rebuilds the block's 4-D mask (causal or sliding-window, for the configured attention implementation) from the
    ``(N, S)`` padding mask, and the rotary cos/sin from the positions, with the model's rotary module, then calls
    the block as the model's forward does. With ``rows``, decodes incrementally with its own key/value cache (see
    :class:`CachedDecoderBlock`).

    Args:
        model: the model.
        block: path of the block (``"model.layers.2"``).
        rotary: path of the model's rotary embedding (``"model.rotary_emb"``); held by every block layer (its
            buffers are not saved, so no name is added to the checkpoint).
        layer_index: the block's index in the model (which mask it uses).
    """

    def __init__(self, model: PreTrainedModel, block: str, rotary: str, layer_index: int) -> None:
        super().__init__(model, [block, rotary], layer_index)
        self._block, self._rotary = block, rotary

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, *rows = value
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows[0] if rows else None)
        cos_sin = self.part(self._rotary)(hidden, position_ids=position_ids)
        hidden = self.part(self._block)(
            hidden,
            attention_mask=mask,
            position_embeddings=cos_sin,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return (hidden, attention_mask, position_ids, *rows)


class GPT2Block(CachedDecoderBlock):
    """One GPT-2 block: ``(hidden, attention_mask, position_ids[, rows])`` to the same, with the causal mask
    rebuilt; with ``rows``, decodes incrementally with its own key/value cache (see :class:`CachedDecoderBlock`).

    Args:
        model: the model.
        block: path of the block (``"transformer.h.2"``).
        layer_index: the block's index in the model; default: the number in ``block``'s path.
    """

    def __init__(self, model: PreTrainedModel, block: str, layer_index: Optional[int] = None) -> None:
        super().__init__(model, [block], int(block.rsplit(".", 1)[1]) if layer_index is None else layer_index)
        self._block = block

    def forward(self, value: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        hidden, attention_mask, position_ids, *rows = value
        cache, mask = self.cache_and_mask(hidden, attention_mask, position_ids, rows[0] if rows else None)
        hidden = self.part(self._block)(
            hidden, cache, mask, None, use_cache=cache is not None, position_ids=position_ids
        )
        return (hidden, attention_mask, position_ids, *rows)


class FinalNorm(HFLayer):
    """The final norm: ``(hidden, ...)`` to the normalised hidden states ``(N, S, H)`` (a tensor: the head needs
    nothing else).

    Args:
        model: the model.
        norm: path of the norm (``"model.norm"``).
    """

    def __init__(self, model: PreTrainedModel, norm: str) -> None:
        super().__init__(model, [norm])
        self._norm = norm

    def forward(self, value: tuple[Tensor, ...]) -> Tensor:
        return self.part(self._norm)(value[0])


class Head(HFLayer):
    """The output head: hidden states ``(N, S, H)`` to logits ``(N, S, V)`` (or a tuple whose first item is the
    hidden states).

    Args:
        model: the model.
        head: path of the head (``"lm_head"``, ``"cls"``).
    """

    def __init__(self, model: PreTrainedModel, head: str) -> None:
        super().__init__(model, [head])
        self._head = head

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor:
        return self.part(self._head)(value[0] if isinstance(value, tuple) else value)


# --------------------------------------------------------------------------- encoders: BERT


class EncoderEmbedding(HFLayer):
    """BERT's embeddings: ``(input_ids, attention_mask, token_type_ids)``, each ``(N, S)`` long, to
    ``(hidden (N, S, H), attention_mask)``; positions are the model's default ``0 .. S-1``.

    Args:
        model: the model.
        embeddings: path of the embeddings module (``"bert.embeddings"``).
    """

    def __init__(self, model: PreTrainedModel, embeddings: str) -> None:
        super().__init__(model, [embeddings])
        self._embeddings = embeddings

    def forward(self, value: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        input_ids, attention_mask, token_type_ids = value
        return self.part(self._embeddings)(input_ids=input_ids, token_type_ids=token_type_ids), attention_mask


class EncoderBlock(HFLayer):
    """One BERT layer: ``(hidden, attention_mask)`` to the same, with the bidirectional mask rebuilt.

    Args:
        model: the model.
        block: path of the layer (``"bert.encoder.layer.2"``).
    """

    def __init__(self, model: PreTrainedModel, block: str) -> None:
        super().__init__(model, [block])
        self._block = block

    def forward(self, value: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        hidden, attention_mask = value
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        return self.part(self._block)(hidden, mask), attention_mask


class PooledClassifier(HFLayer):
    """BERT's sequence-classification head: ``(hidden, attention_mask)`` to logits ``(N, num_labels)`` through the
    pooler (first token), dropout and classifier.

    Args:
        model: the model.
        pooler: path of the pooler (``"bert.pooler"``).
        dropout: path of the dropout (``"dropout"``).
        classifier: path of the classifier (``"classifier"``).
    """

    def __init__(self, model: PreTrainedModel, pooler: str, dropout: str, classifier: str) -> None:
        super().__init__(model, [pooler, dropout, classifier])
        self._pooler, self._dropout, self._classifier = pooler, dropout, classifier

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        pooled = self.part(self._pooler)(value[0])
        return self.part(self._classifier)(self.part(self._dropout)(pooled))


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """How to cut one architecture into backbone layers.

    Attributes:
        name: a short name, for messages (``"llama"``).
        classes: the model class names it takes (``"LlamaForCausalLM"``...).
        layers: builds the layers from a model of one of those classes.
        inputs: what the backbone takes, for messages and docs (``"(input_ids, attention_mask, position_ids)"``).
    """

    name: str
    classes: tuple[str, ...]
    layers: Callable[[PreTrainedModel], list[nn.Module]]
    inputs: str


def _llama_layers(model: PreTrainedModel) -> list[nn.Module]:
    count = model.config.num_hidden_layers
    return [
        DecoderEmbedding(model, "model.embed_tokens"),
        *(RotaryDecoderBlock(model, f"model.layers.{i}", "model.rotary_emb", i) for i in range(count)),
        FinalNorm(model, "model.norm"),
        Head(model, "lm_head"),
    ]


def _gpt2_layers(model: PreTrainedModel) -> list[nn.Module]:
    return [
        DecoderEmbedding(model, "transformer.wte", "transformer.wpe", "transformer.drop"),
        *(GPT2Block(model, f"transformer.h.{i}") for i in range(model.config.num_hidden_layers)),
        FinalNorm(model, "transformer.ln_f"),
        Head(model, "lm_head"),
    ]


def _bert_layers(model: PreTrainedModel) -> list[nn.Module]:
    if model.config.is_decoder or getattr(model.config, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} with is_decoder=True or add_cross_attention=True: the BERT family pipelines"
            " bidirectional encoders only."
        )
    blocks = [EncoderBlock(model, f"bert.encoder.layer.{i}") for i in range(model.config.num_hidden_layers)]
    if type(model).__name__ == "BertForSequenceClassification":
        head: nn.Module = PooledClassifier(model, "bert.pooler", "dropout", "classifier")
    else:
        head = Head(model, "cls")
    return [EncoderEmbedding(model, "bert.embeddings"), *blocks, head]


FAMILIES: list[Family] = [
    Family(
        "llama",
        ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
        _llama_layers,
        "(input_ids, attention_mask, position_ids)",
    ),
    Family("gpt2", ("GPT2LMHeadModel",), _gpt2_layers, "(input_ids, attention_mask, position_ids)"),
    Family(
        "bert",
        ("BertForMaskedLM", "BertForSequenceClassification"),
        _bert_layers,
        "(input_ids, attention_mask, token_type_ids)",
    ),
]
"""The registered families, searched in order by :func:`family_of`."""


def register_family(family: Family) -> None:
    """Add ``family`` to :data:`FAMILIES` (first, so it wins over a built-in family taking the same class)."""
    FAMILIES.insert(0, family)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` that takes ``model``'s class.

    Raises:
        UnsupportedModelError: if no family takes it; the message names the class and the supported classes.
    """
    name = type(model).__name__
    for family in FAMILIES:
        if name in family.classes:
            return family
    supported = ", ".join(c for family in FAMILIES for c in family.classes)
    raise UnsupportedModelError(
        f"lightning_gpipe.hf cannot pipeline {name}: no registered family takes it (supported: {supported}). A model"
        " of another architecture needs a Family that cuts it into tensor-only layers: see docs/transformers.md,"
        " 'Adding a family'."
    )


def to_sequential(model: PreTrainedModel, weights: Optional[Any] = None) -> nn.Sequential:
    """The backbone of ``model``: embeddings -> one layer per block -> final norm -> head, sharing its modules.

    Nothing is copied: the layers hold ``model``'s modules (under their names in ``model``, see :class:`HFLayer`),
    so training the backbone trains ``model``, ``model.save_pretrained`` saves it, and ``model``'s tied parameters
    are one ``nn.Parameter`` in two layers. Call it on a model built on the meta device to let each stage allocate
    only its own layers (they initialise, or load from ``weights``, in :meth:`HFLayer.reset_parameters`).

    The backbone takes ``(input_ids, attention_mask, position_ids)`` for decoders and ``(input_ids,
    attention_mask, token_type_ids)`` for BERT, each ``(N, S)`` long (the mask 1 for real tokens, 0 for padding;
    :func:`positions_from_mask` gives decoder positions), and returns the logits ``(N, S, V)`` (``(N,
    num_labels)`` for sequence classification). Applied layer by layer on one device it equals ``model``'s own
    forward (tested to 1e-5 in fp32, gradients included).

    Args:
        model: a ``transformers`` model of a registered family (:data:`FAMILIES`), in training or eval mode.
        weights: a :class:`~lightning_gpipe.hf.weights.SafetensorsWeights` the layers load from when they are
            materialised (meta-device builds), or ``None`` (default) to initialise new weights as the model does.

    Returns:
        The ``nn.Sequential`` of :class:`HFLayer` layers.

    Raises:
        UnsupportedModelError: for a model class no family takes, naming it (before any step runs).
        ValueError: if the layers leave a parameter or buffer of ``model`` out (a family that misses a module).
    """
    family = family_of(model)
    layers = family.layers(model)
    held = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in held]
    if missing:
        raise ValueError(
            f"The {family.name} family's layers leave {len(missing)} tensors of {type(model).__name__} out"
            f" ({', '.join(missing[:3])}...): its layers must hold every module with parameters or buffers."
        )
    for layer in layers:
        if isinstance(layer, HFLayer):
            layer.weights = weights
    return nn.Sequential(*layers)


def hf_name(layer_name: str) -> str:
    """The model's name of a backbone state-dict entry: ``"3.model.layers.2.mlp.up_proj.weight"`` (relative to the
    backbone) to ``"model.layers.2.mlp.up_proj.weight"``."""
    return layer_name.split(".", 1)[1]
