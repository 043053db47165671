"""Packed rows: several documents in a row, no padding between them, each numbered from position 0, and attention kept
inside each document.

:func:`pack_documents` fills rows with whole documents, :func:`packed_batch` makes them a batch as
:class:`~lightning_gpipe.hf.CausalLM` takes it, :func:`decoder_input` numbers each row's documents for the blocks (and
gives any batch's decoder input), and :func:`document_mask` narrows a block's mask to its document. Tensor operations
only on the way through the pipeline: shapes change every step without a host synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def decoder_input(
    input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
) -> tuple[Tensor, ...]:
    """A decoder backbone's input for a training or evaluation batch, each item ``(N, S)`` long (the mask all ones
    when ``None``).

    Without ``position_ids``: ``(input_ids, attention_mask, position_ids)``, positions ``0 .. S-1`` as the model's
    forward numbers a batch given no positions. With them, a batch of packed rows (several documents in a row, each
    numbered from 0): ``(input_ids, attention_mask, position_ids, documents)``, where ``documents`` numbers each
    row's documents (a new one wherever a real token's position is 0; the padding at a row's end goes with its last
    document) and every block keeps attention inside a document (:func:`document_mask`). Tensor operations only: no
    host synchronisation.
    """
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if position_ids is not None:
        documents = ((position_ids == 0) & (mask != 0)).long().cumsum(-1)
        return input_ids, mask, position_ids, documents
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1).contiguous()
    return input_ids, mask, positions


def pack_documents(documents: Sequence[Sequence[int]], row_length: int, window: int = 64) -> list[list[Sequence[int]]]:
    """``documents`` (token ids each) packed into rows of at most ``row_length`` tokens, no document split: each goes
    to the first of the last ``window`` rows it fits in, else starts a row (first fit over a window: rows come out
    nearly full, in about the documents' order, in ``O(len(documents) * window)``).

    Raises:
        ValueError: for a document longer than ``row_length`` (cut it first).
    """
    rows: list[list[Sequence[int]]] = []
    free: list[int] = []  # tokens left in each row
    for document in documents:
        if len(document) > row_length:
            raise ValueError(f"A document of {len(document)} tokens does not fit rows of {row_length}: cut it first.")
        first = max(len(rows) - window, 0)
        row = next((i for i in range(first, len(rows)) if free[i] >= len(document)), None)
        if row is None:
            rows.append([])
            free.append(row_length)
            row = len(rows) - 1
        rows[row].append(document)
        free[row] -= len(document)
    return rows


def packed_batch(rows: Sequence[Sequence[Sequence[int]]], pad_token_id: int) -> dict[str, Any]:
    """A batch of packed rows (:func:`pack_documents`) as :class:`~lightning_gpipe.hf.CausalLM` takes it.

    ``input_ids``, ``attention_mask`` (1 on tokens, 0 on the padding at a row's end), ``position_ids`` (each
    document numbered from 0) and ``labels`` (the ids; ``-100`` on padding and on each document's first token, so no
    token predicts the next document's), each ``(N, S)`` long with ``S`` the longest row; and two ints of the whole
    batch, ``num_targets`` (the tokens predicted: each document's length less one) and ``num_rows``, which make the
    loss the mean over the batch's targets under every schedule (:meth:`~lightning_gpipe.hf.CausalLM.loss`).
    """
    length = max(sum(len(document) for document in row) for row in rows)
    ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask, positions = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, row in enumerate(rows):
        start = 0
        for document in row:
            end = start + len(document)
            ids[r, start:end] = torch.tensor(document, dtype=torch.long)
            mask[r, start:end] = 1
            positions[r, start:end] = torch.arange(len(document))
            labels[r, start + 1 : end] = ids[r, start + 1 : end]
            start = end
    targets = sum(max(len(document) - 1, 0) for row in rows for document in row)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": positions,
        "labels": labels,
        "num_targets": targets,
        "num_rows": len(rows),
    }


def same_document(documents: Tensor) -> Callable[..., Tensor]:
    """The mask function (``transformers.masking_utils``' ``and_mask_function``) that lets a query attend only to the
    keys of its own document: ``documents[b, q] == documents[b, kv]``, with ``documents`` ``(N, S)`` long (see
    :func:`decoder_input`); :func:`document_mask`'s way for masks other than eager's and SDPA's."""

    def inner(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Tensor:
        return documents[batch_idx, q_idx] == documents[batch_idx, kv_idx]

    return inner


def document_mask(helper: Callable[..., Any], documents: Tensor, **arguments: Any) -> Any:
    """A layer type's mask (``helper``, one of :data:`~lightning_gpipe.hf.masks.MASKS`, given ``arguments``) kept
    inside each document of packed rows (``documents`` ``(N, S)``, see :func:`decoder_input`): block-diagonal.

    The helper builds the layer type's mask for the attention implementation as for any batch (causal, sliding window
    or chunked, with the padding), without its check whether the mask may be skipped (a host read of the padding
    mask); then a key of another document is masked out: ``False`` in an SDPA boolean mask, the dtype's minimum in an
    eager additive one. Tensor operations only. For another kind of mask (a flex-attention block mask...) the helper
    builds it with :func:`same_document` as its ``and_mask_function`` (element by element: slower).
    """
    mask = helper(**arguments, allow_is_causal_skip=False)
    if isinstance(mask, Tensor) and mask.dim() == 4:
        same = documents[:, None, :, None] == documents[:, None, None, :]
        if mask.dtype == torch.bool:
            return mask & same
        if mask.is_floating_point():
            return mask.masked_fill(~same, torch.finfo(mask.dtype).min)
    return helper(**arguments, and_mask_function=same_document(documents))
