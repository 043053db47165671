"""Split a mini-batch into micro-batches along dim 0, and join them back.

A value is a Tensor or a tuple of items. Tensors are split with
:func:`torch.tensor_split` semantics, so a batch that does not divide by ``chunks``
gives uneven micro-batches (the first ones one row longer). Non-tensor items of a
tuple are repeated unchanged in every micro-batch.
"""

from typing import Any, Union

import torch
from torch import Tensor

Value = Union[Tensor, tuple]


def batch_size(value: Value) -> int:
    """Size of dim 0 shared by the tensors of ``value``.

    Raises:
        TypeError: if ``value`` holds no tensor.
        ValueError: if its tensors disagree on dim 0 or are 0-dimensional.
    """
    tensors = [value] if isinstance(value, Tensor) else [x for x in value if isinstance(x, Tensor)]
    if not tensors:
        raise TypeError(
            f"Expected a Tensor or a tuple holding tensors to split into micro-batches, got {_kind(value)}."
        )
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes or len(sizes) != 1:
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"Every tensor passed to the backbone needs the same batch size in dim 0; got shapes {shapes}."
        )
    return sizes.pop()


def split(value: Value, chunks: int) -> list[Value]:
    """Split ``value`` into ``min(chunks, batch size)`` micro-batches along dim 0.

    Args:
        value: a Tensor of shape (N, ...) or a tuple whose tensors all have N rows.
        chunks: M, the requested number of micro-batches (>= 1).

    Returns:
        A list of values of the same kind as ``value``; rows keep their order.
    """
    count = min(chunks, batch_size(value))
    if isinstance(value, Tensor):
        return list(torch.tensor_split(value, count))
    columns = [torch.tensor_split(x, count) if isinstance(x, Tensor) else [x] * count for x in value]
    return [tuple(column[i] for column in columns) for i in range(count)]


def join(parts: list[Value]) -> Value:
    """Concatenate micro-batches along dim 0; the inverse of :func:`split`.

    Non-tensor items are taken from the first micro-batch.
    """
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts)
    return tuple(
        torch.cat([part[i] for part in parts]) if isinstance(item, Tensor) else item for i, item in enumerate(first)
    )


def _kind(value: Any) -> str:
    return type(value).__name__
