"""Re-materialization (activation checkpointing): which micro-batches recompute, and how they replay randomness.

GPipe (Huang et al. 2019, section 2.2) keeps only the stage-boundary input of a checkpointed
micro-batch and recomputes the rest of its forward during the backward. torchgpipe names the
modes ``"always"``, ``"except_last"`` and ``"never"``; ``"except_last"`` skips the last
micro-batch, whose backward comes first, so its recompute would only add time. The engine, the
simulator and the balance suggestion all ask :func:`checkpointed`, so the rule lives here once.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

CHECKPOINT_MODES = ("always", "except_last", "never")
"""The values of ``GPipeStrategy(checkpoint=...)``."""


def checkpointed(mode: str, index: int, micro_batches: int) -> bool:
    """Whether micro-batch ``index`` of ``micro_batches`` is re-materialized under ``mode``, one of
    :data:`CHECKPOINT_MODES`."""
    return mode == "always" or (mode == "except_last" and index < micro_batches - 1)


def recomputed_share(mode: str, micro_batches: int) -> float:
    """The share (0 to 1) of a mini-batch's ``micro_batches`` micro-batches whose forward is recomputed under
    ``mode``."""
    return sum(checkpointed(mode, i, micro_batches) for i in range(micro_batches)) / micro_batches


class RngState:
    """The random number generator state a checkpointed forward started from, so its recompute draws the same.

    Captures the CPU generator and, for a CUDA stage, the device's generator (as torch.utils.checkpoint
    does), so dropout masks in the recompute equal the fill's.
    """

    def __init__(self, device: torch.device, cpu: Tensor, accelerator: Tensor | None) -> None:
        self.device, self.cpu, self.accelerator = device, cpu, accelerator

    @classmethod
    def capture(cls, device: torch.device) -> "RngState":
        """The current state of the generators that a forward on ``device`` draws from."""
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(device, torch.get_rng_state(), accelerator)

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block from the captured state; the generators are left as they were before the block."""
        devices = [self.device] if self.accelerator is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield
