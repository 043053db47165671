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
"""

import math

import torch
from torch import Tensor, nn

Activation = tuple[Tensor, Tensor, Tensor]
"""``(memory (N, S, d_model) float, tgt (N, T, d_model) float, src_pad (N, S) bool)``."""


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

    def embed(self, ids: Tensor) -> Tensor:
        """``(N, L)`` token ids to ``(N, L, d_model)`` states.

        Raises:
            ValueError: when ``L`` exceeds ``max_length``.
        """
        if ids.shape[1] > self.positions.shape[0]:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds max_length={self.positions.shape[0]}")
        return self.dropout(self.tokens(ids) * self.scale + self.positions[: ids.shape[1]])

    def forward(self, value: tuple[Tensor, Tensor]) -> Activation:
        """``(src (N, S) long, tgt (N, T) long)`` to ``(memory, tgt states, src_pad)``."""
        src, tgt = value
        return self.embed(src), self.embed(tgt), src == self.pad_id


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

    def forward(self, value: Activation) -> Activation:
        """Encode ``memory`` once more; ``tgt`` and ``src_pad`` pass through."""
        memory, tgt, src_pad = value
        return self.layer(memory, src_key_padding_mask=src_pad), tgt, src_pad


class EncoderNorm(nn.Module):
    """The final LayerNorm of a pre-LayerNorm encoder, applied to ``memory``.

    Args:
        d_model: model width.
    """

    def __init__(self, d_model: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)

    def forward(self, value: Activation) -> Activation:
        """Normalise ``memory``; ``tgt`` and ``src_pad`` pass through."""
        memory, tgt, src_pad = value
        return self.norm(memory), tgt, src_pad


class DecoderLayer(nn.Module):
    """One pre-LayerNorm decoder layer (causal self-attention, cross-attention, feed-forward) applied to ``tgt``.

    Args:
        d_model: model width.
        nhead: attention heads.
        dim_feedforward: hidden width of the feed-forward block.
        dropout: dropout probability. Default 0.1.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, dropout: float = 0.1):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(
            d_model, nhead, dim_feedforward, dropout, activation="relu", batch_first=True, norm_first=True
        )

    def forward(self, value: Activation) -> Activation:
        """Decode ``tgt`` once more, attending to earlier target positions and to unpadded ``memory``."""
        memory, tgt, src_pad = value
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device, dtype=tgt.dtype)
        tgt = self.layer(tgt, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=src_pad)
        return memory, tgt, src_pad


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

    def forward(self, value: Activation) -> Tensor:
        """``(memory, tgt, src_pad)`` to logits ``(N, T, vocab_size)``."""
        _, tgt, _ = value
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
