"""litgpt's ``GPT`` cut into backbone layers: the embedding, one layer per block, the final norm, the head.

:func:`to_sequential` builds them without copying a weight. Between layers only tensors travel, the batch in dim 0:
in training and evaluation the token ids ``(N, S)`` long, then the hidden states ``(N, S, E)``, then the logits ``(N,
S, V)``, so the backbone computes what ``GPT.forward(idx)`` computes; for cached decoding
(:func:`~lightning_gpipe.litgpt.generate.greedy_generate`) the values carry two more tensors, ``(x, positions (n, t)
long, rows (n,) long)``. Each block rebuilds what ``GPT.forward`` builds once for all blocks: the rotary cos/sin of
the positions, from the model's rope tables (:class:`RopeTables`, one per stage), and the causal mask (none in
training: the attention's own causal path), and keeps its own key/value caches, litgpt's ``KVCache``, one per set of
rows (:class:`Block`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.litgpt.layer import LitLayer

try:
    from litgpt.model import GPT, batched_index_select, do_softcapping
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError('lightning_gpipe.litgpt needs litgpt: pip install "lightning-gpipe[litgpt]"') from error


class RopeTables(nn.Module):
    """The model's rotary tables, ``cos`` and ``sin`` ``(max_seq_length, rope_n_elem[, 2])``, shared by the block layers
    of a stage (non-persistent buffers, as the model's own: no name in a checkpoint).

    Holds the model's own tensors when it has them; on the meta device, its :meth:`reset_parameters` computes them
    with the model's ``rope_cache`` on the stage's device.

    Args:
        model: the ``GPT``.
    """

    cos: Tensor
    sin: Tensor

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.__dict__["gpt"] = model
        self.register_buffer("cos", model.cos, persistent=False)
        self.register_buffer("sin", model.sin, persistent=False)

    def reset_parameters(self) -> None:
        """Compute the tables on the device they were allocated on (``GPT.rope_cache``)."""
        self.cos, self.sin = self.__dict__["gpt"].rope_cache(device=self.cos.device)


class Embedding(LitLayer):
    """The token embedding: ids ``(N, S)`` to hidden states ``(N, S, E)`` (scaled by ``sqrt(n_embd)`` where the config
    says ``scale_embeddings``, as ``GPT.forward``); for cached decoding ``(ids, positions, rows)`` to ``(hidden,
    positions, rows)``.

    Args:
        model: the ``GPT``.
    """

    def __init__(self, model: GPT) -> None:
        super().__init__(model, ["transformer.wte"])

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        ids, *rest = value if isinstance(value, tuple) else (value,)
        x = self.part("transformer.wte")(ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)
        return (x, *rest) if rest else x


class Block(LitLayer):
    """One block, ``transformer.h.i``: hidden states ``(N, S, E)`` to the same, called as ``GPT.forward`` calls it.

    In training and evaluation the rotary tables are the first ``S`` rows (the positions ``0 .. S-1``) and there is no
    mask (the attention's causal path), as ``GPT.forward`` without ``input_pos``. For cached decoding the value is
    ``(hidden (n, t, E), positions (n, t), rows (n,))``: the new tokens of the rows ``rows`` (which sequences of the
    batch they are; a pipeline splits every decoding step alike) at positions ``positions`` (every row alike, as
    litgpt's ``generate``). The block keeps one litgpt ``KVCache`` per set of rows, built by its attention's
    ``build_kv_cache`` for :attr:`cache_length` positions, and calls the block with ``input_pos`` and
    ``input_pos_maxp1`` and the causal mask rows of those positions, as ``GPT.forward`` does with its caches: each
    stage holds the caches of its own blocks only, and only the new tokens' hidden states travel.

    Args:
        model: the ``GPT``.
        index: the block's index in ``transformer.h``.
        rope: the stage's :class:`RopeTables` (one module shared by the block layers).

    Attributes:
        kv_cache: ``{rows: (KVCache, positions cached)}``, the caches of cached decoding (not in the state dict).
        cache_length: the positions a new cache holds (set by
            :func:`~lightning_gpipe.litgpt.generate.prepare_kv_caches`), ``None`` outside decoding.
    """

    def __init__(self, model: GPT, index: int, rope: RopeTables) -> None:
        super().__init__(model, [f"transformer.h.{index}"])
        self.index, self.rope = index, rope
        self.kv_cache: dict[tuple[int, ...], tuple[Any, int]] = {}
        self.cache_length: int | None = None

    def _tables(self, positions: Tensor | None, length: int) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``(1, length, n_elem)`` of the first ``length`` positions, or of ``positions`` ``(t,)``."""
        if length > self.rope.cos.size(0):
            raise ValueError(
                f"Cannot forward sequence of length {length}, max seq length is only {self.rope.cos.size(0)}."
            )
        if positions is None:
            cos, sin = self.rope.cos[:length].unsqueeze(0), self.rope.sin[:length].unsqueeze(0)
        else:
            cos = batched_index_select(self.rope.cos, 0, positions).unsqueeze(0)
            sin = batched_index_select(self.rope.sin, 0, positions).unsqueeze(0)
        indices = self.config.rope_indices
        if indices is not None:
            cos, sin = cos[..., indices[self.index]], sin[..., indices[self.index]]
        return cos, sin

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        block = self.part(f"transformer.h.{self.index}")
        if not isinstance(value, tuple):
            return block(value, *self._tables(None, value.shape[1]))
        hidden, positions, rows = value
        key, count = tuple(rows.tolist()), hidden.shape[1]
        cache, seen = self._cache(key, hidden)
        if seen + count > cast(int, self.cache_length):
            raise RuntimeError(
                f"Block {self.index}'s key/value cache for rows {list(key)} holds {self.cache_length} positions, but"
                f" {seen + count} are asked for: call `prepare_kv_caches(backbone, length)` with the whole length."
            )
        input_pos = positions[0]
        cos, sin = self._tables(input_pos, seen + count)
        mask = (torch.arange(seen + count, device=hidden.device) <= input_pos[:, None])[None, None]
        attention = cast(Any, block).attn
        attention.kv_cache = cache
        try:
            hidden = block(hidden, cos, sin, mask, input_pos, seen + count)
        finally:
            attention.kv_cache = None
        self.kv_cache[key] = (cache, seen + count)
        return hidden, positions, rows

    def _cache(self, key: tuple[int, ...], hidden: Tensor) -> tuple[Any, int]:
        """The cache of the rows ``key`` and the positions it holds, a new one (litgpt's ``build_kv_cache``) at first.

        Raises:
            RuntimeError: outside cached decoding (no :attr:`cache_length`).
        """
        if self.cache_length is None:
            raise RuntimeError(
                "Cached decoding needs the blocks' cache length: call `prepare_kv_caches(backbone, length)` first"
                " (`greedy_generate` does)."
            )
        if key not in self.kv_cache:
            attention = cast(Any, self.part(f"transformer.h.{self.index}")).attn
            cache = attention.build_kv_cache(
                len(key), self.cache_length, self.rope.cos.size(1), hidden.device, hidden.dtype
            )
            self.kv_cache[key] = (cache, 0)
        return self.kv_cache[key]


class FinalNorm(LitLayer):
    """The final norm, ``transformer.ln_f``: hidden states ``(N, S, E)`` (or a decoding value, whose hidden states
    it takes) to the normalised hidden states.

    Args:
        model: the ``GPT``.
    """

    def __init__(self, model: GPT) -> None:
        super().__init__(model, ["transformer.ln_f"])

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor:
        hidden = value[0] if isinstance(value, tuple) else value
        return self.part("transformer.ln_f")(hidden)


class Head(LitLayer):
    """The output head, ``lm_head``: hidden states ``(N, S, E)`` to logits ``(N, S, padded_vocab_size)``,
    soft-capped where the config says ``final_logit_softcapping``, as ``GPT.forward``.

    Args:
        model: the ``GPT``.
    """

    def __init__(self, model: GPT) -> None:
        super().__init__(model, ["lm_head"])

    def forward(self, hidden: Tensor) -> Tensor:
        logits = self.part("lm_head")(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else do_softcapping(logits, thresh=cap)


def backbone_layers(model: GPT) -> list[LitLayer]:
    """``model``'s backbone layers: :class:`Embedding`, a :class:`Block` per block (sharing one :class:`RopeTables`),
    :class:`FinalNorm`, :class:`Head`."""
    rope = RopeTables(model)
    blocks = [Block(model, i, rope) for i in range(len(cast(nn.ModuleList, model.transformer.h)))]
    return [Embedding(model), *blocks, FinalNorm(model), Head(model)]
