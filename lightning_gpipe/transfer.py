"""Point-to-point transfer of activations and gradients between neighbouring stages.

Every activation message starts with a shape header, so shapes may change from
step to step and between micro-batches (variable-length text, uneven last
micro-batch). Gradients need no header: the receiver of a gradient is the stage
that sent the activation, so it already knows the shapes.

Wire format of one activation (all int64, then the tensors in order)::

    [header length]  [count, is_tuple, n, (dtype, ndim, *shape) * n]  tensor_0 ... tensor_{n-1}

``count`` is the number of micro-batches of the current mini-batch, so that stages
after the first learn it from the first message. Sends are asynchronous and
overlap the next micro-batch's compute; receives block. Works with any
torch.distributed backend that has ``isend``/``irecv`` (gloo on CPU, NCCL on GPU).
"""

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.failure import naming_the_cause

Value = Union[Tensor, tuple]

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


class Link:
    """The connections of one stage to the stage before and the stage after it.

    Args:
        prev_rank: global rank of the previous stage, ``None`` on the first stage.
        next_rank: global rank of the next stage, ``None`` on the last stage.
        device: device of this stage; headers and received tensors are put there.
    """

    def __init__(self, prev_rank: Optional[int], next_rank: Optional[int], device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: list[tuple[dist.Work, Tensor]] = []

    def send_activation(self, value: Value, count: int) -> None:
        """Send one micro-batch's output (a Tensor or tuple of tensors) to the next stage, asynchronously.

        Args:
            value: the micro-batch activation; tensors keep dtype and shape.
            count: M, the number of micro-batches in this mini-batch.
        """
        tensors = [value] if isinstance(value, Tensor) else list(value)
        header = [count, int(not isinstance(value, Tensor)), len(tensors)]
        for tensor in tensors:
            header += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        header_tensor = torch.tensor(header, dtype=torch.int64, device=self.device)
        self._isend(torch.tensor([len(header)], dtype=torch.int64, device=self.device), self.next_rank)
        self._isend(header_tensor, self.next_rank)
        for tensor in tensors:
            self._isend(_wire(tensor.detach()), self.next_rank)

    def recv_activation(self) -> tuple[Value, int]:
        """Receive one micro-batch's input from the previous stage.

        Returns:
            ``(value, count)``: the activation (Tensor or tuple, as sent) and M.
        """
        length = self._recv(torch.empty(1, dtype=torch.int64, device=self.device), self.prev_rank)
        header = self._recv(torch.empty(int(length), dtype=torch.int64, device=self.device), self.prev_rank).tolist()
        count, is_tuple, n = header[:3]
        tensors, pos = [], 3
        for _ in range(n):
            dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
            shape = header[pos + 2 : pos + 2 + ndim]
            pos += 2 + ndim
            buffer = torch.empty(shape, dtype=torch.uint8 if dtype is torch.bool else dtype, device=self.device)
            tensors.append(self._recv(buffer, self.prev_rank).view(dtype))
        return (tuple(tensors) if is_tuple else tensors[0]), count

    def send_grads(self, grads: list[Tensor]) -> None:
        """Send the gradients of the received floating-point inputs back to the previous stage, asynchronously."""
        for grad in grads:
            self._isend(grad.contiguous(), self.prev_rank)

    def recv_grads(self, outputs: list[Tensor]) -> list[Tensor]:
        """Receive the gradients of ``outputs`` (this stage's floating-point outputs) from the next stage."""
        return [self._recv(torch.empty_like(out, memory_format=torch.contiguous_format), self.next_rank) for out in outputs]

    def flush(self) -> None:
        """Wait until every pending send has completed."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            _wait(work)

    def _isend(self, tensor: Tensor, dst: Optional[int]) -> None:
        # the tensor is kept alive with its work until the send completes
        self._pending.append((dist.isend(tensor, dst), tensor))

    @staticmethod
    def _recv(buffer: Tensor, src: Optional[int]) -> Tensor:
        _wait(dist.irecv(buffer, src))
        return buffer


def _wire(tensor: Tensor) -> Tensor:
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if tensor.dtype is torch.bool else tensor


def _wait(work: dist.Work) -> None:
    with naming_the_cause():
        work.wait()
