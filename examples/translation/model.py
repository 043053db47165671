"""The encoder-decoder Transformer of the translation example as ONE ``nn.Sequential`` backbone.

Vaswani et al. 2017 ("Attention Is All You Need") with pre-LayerNorm residual
blocks (Xiong et al. 2020), the layout GPipe trains for multilingual
translation (Huang et al. 2019, arXiv:1811.06965, section 5). Every layer maps
a tuple of tensors with the batch in dim 0 to a tuple of the same kind, so the
GPipe strategy can cut the backbone between any two layers and split each
activation into micro-batches:

====================  ======================================  =====================================
layer                 input                                   output
====================  ======================================  =====================================
:class:`Embedding`    ``(src ids (N, S), tgt ids (N, T))``    ``(memory, tgt, src_pad)``
:class:`EncoderLayer` ``(memory, tgt, src_pad)``              same, ``memory`` encoded once more
:class:`EncoderNorm`  ``(memory, tgt, src_pad)``              same, ``memory`` normalised
:class:`DecoderLayer` ``(memory, tgt, src_pad)``              same, ``tgt`` decoded once more
:class:`OutputLayer`  ``(memory, tgt, src_pad)``              logits ``(N, T, vocab)``
====================  ======================================  =====================================

``memory`` is ``(N, S, d_model)`` float (source states), ``tgt`` is ``(N, T,
d_model)`` float (target states) and ``src_pad`` is ``(N, S)`` bool, True at
source padding. Target padding needs no mask: it sits after the real tokens,
which the causal mask already hides it from. Attention and feed-forward blocks
are torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``
with ``norm_first=True``.

Incremental decoding with a key/value cache (evaluation only): the backbone
input ``(src, tgt, rows, position)`` adds ``rows`` ``(N,)`` long, the row of
each sequence in the decoder layers' caches, and ``position`` ``(N,)`` long,
the position of ``tgt``'s first token (the same in every row). Every activation
then carries ``rows`` and ``position`` as two more items (:data:`Step`). The
first step gives the whole source and ``<s>``; the encoder runs and each
:class:`DecoderLayer` keeps the keys and values of ``memory`` and of ``<s>``
in its :class:`KeyValueCache`. Later steps give an empty source ``(N, 0)`` and
only the new target tokens: the encoder layers pass the empty ``memory``
through, and the decoder layers attend to their cached keys and values, so a
step costs one token per row, not the whole prefix. Each layer caches only its
own keys and values, so on a pipeline every stage keeps its own layers'
caches; the rows travel with the activation, so any micro-batch split finds
its rows. :func:`reorder_caches` picks rows between steps (beam search), and
:func:`clear_caches` frees them.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Activation = tuple[Tensor, Tensor, Tensor]
"""``(memory (N, S, d_model) float, tgt (N, T, d_model) float, src_pad (N, S) bool)``."""

Step = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]
"""An activation of incremental decoding: :data:`Activation` plus ``rows (N,) long`` and ``position (N,) long``
(see the module docstring); ``memory`` and ``src_pad`` have ``S = 0`` after the first step."""


def sinusoidal_positions(length: int, d_model: int) -> Tensor:
    """Sinusoidal position encodings ``(length, d_model)`` (Vaswani et al. 2017, section 3.5).

    Args:
        length: number of positions.
        d_model: model width (even).
    """
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(length, d_model)
    encoding[:, 0::2] = torch.sin(position * frequency)
    encoding[:, 1::2] = torch.cos(position * frequency)
    return encoding


class Embedding(nn.Module):
    """Shared token embedding of source and target, scaled by sqrt(d_model), plus sinusoidal positions.

    The first backbone layer: token ids in, the tuple activation out.

    Args:
        vocab_size: entries of the shared subword vocabulary.
        d_model: model width.
        pad_id: id of the padding token (its embedding stays zero and gets no gradient).
        max_length: longest sequence, in tokens. Default 1024.
        dropout: dropout after adding positions. Default 0.1.
    """

    def __init__(self, vocab_size: int, d_model: int, pad_id: int, max_length: int = 1024, dropout: float = 0.1):
        super().__init__()
        self.pad_id = pad_id
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.tokens.weight, std=d_model**-0.5)
        with torch.no_grad():
            self.tokens.weight[pad_id].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_length, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(d_model)

    def embed(self, ids: Tensor, start: int = 0) -> Tensor:
        """``(N, L)`` token ids at positions ``start`` to ``start + L - 1`` to ``(N, L, d_model)`` states.

        Raises:
            ValueError: when ``start + L`` exceeds ``max_length``.
        """
        end = start + ids.shape[1]
        if end > self.positions.shape[0]:
            raise ValueError(f"sequence of {end} tokens exceeds max_length={self.positions.shape[0]}")
        return self.dropout(self.tokens(ids) * self.scale + self.positions[start:end])

    def forward(self, value: tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]) -> Activation | Step:
        """``(src (N, S) long, tgt (N, T) long)`` to ``(memory, tgt states, src_pad)``; with ``rows`` and
        ``position`` (incremental decoding), ``tgt`` starts at ``position`` and both travel on (:data:`Step`)."""
        src, tgt, *step = value
        start = int(step[1][0]) if step else 0
        return self.embed(src), self.embed(tgt, start), src == self.pad_id, *step


class EncoderLayer(nn.Module):
    """One pre-LayerNorm encoder layer (self-attention, feed-forward) applied to ``memory``.

    Args:
        d_model: model width.
        nhead: attention heads.
        dim_feedforward: hidden width of the feed-forward block.
        dropout: dropout probability. Default 0.1.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float = 0.1):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation="relu", batch_first=True, norm_first=True
        )

    def forward(self, value: Activation | Step) -> Activation | Step:
        """Encode ``memory`` once more; the other items pass through, and so does an empty ``memory`` (a
        cached decoding step after the first)."""
        memory, tgt, src_pad, *step = value
        if memory.shape[1]:
            memory = self.layer(memory, src_key_padding_mask=src_pad)
        return memory, tgt, src_pad, *step


class EncoderNorm(nn.Module):
    """The final LayerNorm of a pre-LayerNorm encoder, applied to ``memory``.

    Args:
        d_model: model width.
    """

    def __init__(self, d_model: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, value: Activation | Step) -> Activation | Step:
        """Normalise ``memory``; the other items pass through."""
        memory, tgt, src_pad, *step = value
        return self.norm(memory), tgt, src_pad, *step


class KeyValueCache:
    """The keys and values one :class:`DecoderLayer` has computed for the sequences being decoded.

    Rows are sequences (in the order of the ``rows`` the decoding steps give), keys and values are
    ``(rows, nhead, length, d_model / nhead)``: ``memory_keys`` / ``memory_values`` of the source states
    (cross-attention, computed once), ``keys`` / ``values`` of the target tokens so far (self-attention,
    one position more every step; room grows by doubling). ``memory_pad`` ``(rows, S)`` bool marks source
    padding. Rows are added as the micro-batches of the first step arrive, each with its own ``rows``.
    """

    def __init__(self) -> None:
        self.memory_keys: Tensor | None = None
        self.memory_values: Tensor | None = None
        self.memory_pad: Tensor | None = None
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def add_memory(self, rows: Tensor, keys: Tensor, values: Tensor, pad: Tensor) -> None:
        """Store the cross-attention keys and values ``(n, nhead, S, head_dim)`` and padding ``(n, S)`` of
        ``rows`` ``(n,)``."""
        size = int(rows.max()) + 1
        self.memory_keys = _store(self.memory_keys, rows, keys, size)
        self.memory_values = _store(self.memory_values, rows, values, size)
        self.memory_pad = _store(self.memory_pad, rows, pad, size)

    def append(self, rows: Tensor, start: int, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store the self-attention keys and values ``(n, nhead, t, head_dim)`` of positions ``start`` to
        ``start + t - 1`` of ``rows``; return ``rows``' keys and values of positions 0 to ``start + t - 1``."""
        end = start + keys.shape[2]
        size = max(int(rows.max()) + 1, 0 if self.keys is None else self.keys.shape[0])
        room = self.keys.shape[2] if self.keys is not None else 1
        while room < end:
            room *= 2
        for name, new in (("keys", keys), ("values", values)):
            buffer = _grow(getattr(self, name), size, room, new)
            buffer[rows, :, start:end] = new
            setattr(self, name, buffer)
        return self.keys[rows, :, :end], self.values[rows, :, :end]

    def reorder(self, parents: Tensor) -> None:
        """Row ``i`` becomes the former row ``parents[i]`` in every cached tensor (``parents`` ``(n,)`` long)."""
        for name in ("memory_keys", "memory_values", "memory_pad", "keys", "values"):
            cached = getattr(self, name)
            if cached is not None:
                setattr(self, name, cached[parents.to(cached.device)])


def _grow(buffer: Tensor | None, rows: int, length: int, like: Tensor) -> Tensor:
    """``buffer`` (rows in dim 0, positions in dim 2) with room for ``rows`` rows and ``length`` positions."""
    shape = (rows, like.shape[1], length, *like.shape[3:])
    if buffer is not None and buffer.shape[0] >= rows and buffer.shape[2] >= length:
        return buffer
    grown = like.new_zeros(shape)
    if buffer is not None:
        grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
    return grown


def _store(buffer: Tensor | None, rows: Tensor, new: Tensor, size: int) -> Tensor:
    """``buffer`` grown to ``size`` rows (dim 0) with ``new`` written at ``rows``."""
    if buffer is None or buffer.shape[0] < size:
        grown = new.new_zeros((size, *new.shape[1:]))
        if buffer is not None:
            grown[: buffer.shape[0]] = buffer
        buffer = grown
    buffer[rows] = new
    return buffer


class DecoderLayer(nn.Module):
    """One pre-LayerNorm decoder layer (causal self-attention, cross-attention, feed-forward) applied to ``tgt``.

    Args:
        d_model: model width.
        nhead: attention heads.
        dim_feedforward: hidden width of the feed-forward block.
        dropout: dropout probability. Default 0.1.

    Attributes:
        cache: the :class:`KeyValueCache` of incremental decoding (not part of the state dict).
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float = 0.1):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation="relu", batch_first=True, norm_first=True
        )
        self.cache = KeyValueCache()

    def forward(self, value: Activation | Step) -> Activation | Step:
        """Decode ``tgt`` once more, attending to earlier target positions and to unpadded ``memory``.

        A :data:`Step` (incremental decoding) goes through :meth:`decode_step`.
        """
        if len(value) == 5:
            return self.decode_step(*value)
        memory, tgt, src_pad = value
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=tgt.dtype)
        tgt = self.layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=src_pad)
        return memory, tgt, src_pad

    def decode_step(self, memory: Tensor, tgt: Tensor, src_pad: Tensor, rows: Tensor, position: Tensor) -> Step:
        """The layer's computation for the new target tokens ``tgt`` ``(n, t, d_model)`` of ``rows``, with the
        keys and values of earlier tokens and of the source taken from :attr:`cache`.

        A non-empty ``memory`` (the first step) fills the cache's cross-attention keys and values. The result
        equals :meth:`forward` on the whole prefix at the new positions (the same weights, up to float
        rounding). Evaluation only: dropout is not applied.

        Raises:
            RuntimeError: in training mode.
        """
        if self.training:
            raise RuntimeError("cached decoding runs in evaluation mode only; call `.eval()` first")
        layer, start = self.layer, int(position[0])
        if memory.shape[1]:
            keys, values = _heads(layer.multihead_attn, memory, 1)
            self.cache.add_memory(rows, keys, values, src_pad)
        (query, keys, values) = _heads(layer.self_attn, layer.norm1(tgt), 0)
        keys, values = self.cache.append(rows, start, keys, values)
        new = torch.arange(start, start + tgt.shape[1], device=tgt.device)
        causal = torch.arange(keys.shape[2], device=tgt.device) <= new[:, None]
        x = tgt + _attend(layer.self_attn, query, keys, values, causal)
        (query,) = _heads(layer.multihead_attn, layer.norm2(x), 0, parts=1)
        unpadded = ~self.cache.memory_pad[rows][:, None, None, :]
        x = x + _attend(layer.multihead_attn, query, self.cache.memory_keys[rows], self.cache.memory_values[rows],
                        unpadded)  # fmt: skip
        x = x + layer.linear2(layer.activation(layer.linear1(layer.norm3(x))))
        return memory, x, src_pad, rows, position


def _heads(attention: nn.MultiheadAttention, x: Tensor, first: int, parts: int | None = None) -> list[Tensor]:
    """Project ``x`` ``(n, t, d_model)`` with ``attention``'s input weights ``first`` to ``first + parts - 1``
    (0 query, 1 key, 2 value; ``parts`` defaults to the rest), split into heads ``(n, nhead, t, head_dim)``."""
    d = attention.embed_dim
    parts = 3 - first if parts is None else parts
    rows = slice(first * d, (first + parts) * d)
    projected = F.linear(x, attention.in_proj_weight[rows], attention.in_proj_bias[rows])
    heads = projected.unflatten(-1, (parts, attention.num_heads, d // attention.num_heads))
    return list(heads.permute(2, 0, 3, 1, 4))


def _attend(attention: nn.MultiheadAttention, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Scaled dot-product attention of ``(n, nhead, t, head_dim)`` queries over keys and values where the bool
    ``mask`` is True, heads joined and projected by ``attention``'s output layer: ``(n, t, d_model)``."""
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
    return attention.out_proj(out.transpose(1, 2).flatten(2))


def reorder_caches(backbone: nn.Module, parents: Tensor) -> None:
    """Reorder the key/value caches of the backbone's decoder layers: row ``i`` continues row ``parents[i]``.

    Called between incremental decoding steps on every stage (each reorders the layers it holds), e.g. to
    follow the beams beam search keeps, or to repeat each source's rows for its beams.

    Args:
        backbone: the backbone, or the part of it a pipeline stage holds.
        parents: ``(n,)`` long, the former row of each new row.
    """
    for module in backbone.modules():
        if isinstance(module, DecoderLayer):
            module.cache.reorder(parents)


def clear_caches(backbone: nn.Module) -> None:
    """Empty the key/value caches of the backbone's decoder layers (before and after decoding a batch)."""
    for module in backbone.modules():
        if isinstance(module, DecoderLayer):
            module.cache = KeyValueCache()


class OutputLayer(nn.Module):
    """The decoder's final LayerNorm and the projection to vocabulary logits: the last backbone layer.

    Args:
        d_model: model width.
        vocab_size: entries of the subword vocabulary.
    """

    def __init__(self, d_model: int, vocab_size: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.projection = nn.Linear(d_model, vocab_size)

    def forward(self, value: Activation | Step) -> Tensor:
        """``(memory, tgt, src_pad)`` (or a :data:`Step`) to logits ``(N, T, vocab_size)``."""
        _, tgt, *_ = value
        return self.projection(self.norm(tgt))


def transformer(
    vocab_size: int,
    pad_id: int,
    d_model: int = 256,
    nhead: int = 4,
    num_encoder_layers: int = 3,
    num_decoder_layers: int = 3,
    dim_feedforward: int = 1024,
    dropout: float = 0.1,
    max_length: int = 1024,
    tie_embeddings: bool = False,
) -> nn.Sequential:
    """The whole encoder-decoder as one ``nn.Sequential`` of ``num_encoder_layers + num_decoder_layers + 3`` layers.

    Layers: :class:`Embedding`, the encoder layers, :class:`EncoderNorm`, the
    decoder layers, :class:`OutputLayer`. GPipe's T(L, H, A) has L = the layers
    of encoder and decoder together, H = ``d_model`` and A = ``nhead``, with
    ``dim_feedforward = 4 H`` (Huang et al. 2019, section 5).

    Args:
        vocab_size: entries of the shared subword vocabulary.
        pad_id: id of the padding token.
        d_model: model width H. Default 256.
        nhead: attention heads A. Default 4.
        num_encoder_layers: encoder layers. Default 3.
        num_decoder_layers: decoder layers. Default 3.
        dim_feedforward: feed-forward hidden width. Default 1024.
        dropout: dropout probability. Default 0.1.
        max_length: longest source or target sequence, in tokens. Default 1024.
        tie_embeddings: the output projection uses the token embedding's weight (one table for source, target
            and output, Press & Wolf 2017); on different stages, GPipeStrategy keeps the copies in step.
            Default False.

    Raises:
        ValueError: when ``d_model`` is not divisible by ``nhead`` or is odd.
    """
    if d_model % nhead or d_model % 2:
        raise ValueError(f"d_model={d_model} must be even and divisible by nhead={nhead}")
    embedding, output = Embedding(vocab_size, d_model, pad_id, max_length, dropout), OutputLayer(d_model, vocab_size)
    if tie_embeddings:
        output.projection.weight = embedding.tokens.weight
    return nn.Sequential(
        embedding,
        *(EncoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_encoder_layers)),
        EncoderNorm(d_model),
        *(DecoderLayer(d_model, nhead, dim_feedforward, dropout) for _ in range(num_decoder_layers)),
        output,
    )
