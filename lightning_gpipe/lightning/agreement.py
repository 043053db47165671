"""The stages' agreement before each step: did they read the same batch, and does any of them ask to stop?

The stages of a pipeline each read the batch from their own data loader: the first feeds its rows to the
backbone, the last pairs the backbone's output with its labels. If the loaders diverge (a sampler drawing from
each process's own random generator, random augmentation on the data path, a non-deterministic loader), the
model trains on inputs paired with other rows' labels, and nothing fails. So before each step the processes
all-reduce one small tensor: a fingerprint of each replica's batch (:func:`fingerprint`) and the stop requests
(a SIGTERM, SLURM's requeue signal) that must take effect on every process at the same step. A fingerprint that
differs between the stages of a pipeline stops the job on every process with :class:`BatchMismatchError`,
naming the batch.

The tensor holds, for each data-parallel replica, the maximum of its stages' fingerprints and the maximum of
their negations (equal stages: ``max == -max(-x)``), and for each request the maximum of the processes' flags;
slots of other replicas hold the reduction's neutral element. One all-reduce of ``2 + 2 * replicas`` int64
numbers, posted where Lightning's loop already synchronises the processes at the start of every batch.
"""

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten

from lightning_gpipe.faults import collectives

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job

_NEUTRAL = torch.iinfo(torch.int64).min
_COLUMNS = 16
"""Values of each row of a tensor that go into a fingerprint, evenly spaced over the row."""

_PLAIN = (str, bytes, int, float, bool, type(None))


class BatchMismatchError(RuntimeError):
    """Raised on every process alike when the stages of a pipeline would train on different data: the last stage
    would pair the first stage's rows with other rows' labels.

    Two cases, each with its cause and fix in the message:

    - when a loop starts (before its first step), the stages hold different **datasets** (a different length, or
      different first, middle or last items; see :func:`~lightning_gpipe.lightning.data.same_datasets`): each
      process builds its data itself, so data made from randomness nobody seeded differs. Seed before building
      it;
    - before a step, the stages read different **batches** from datasets that agreed (see :class:`StepAgreement`):
      a sampler or shuffle drawing from each process's own generator, augmentation that does not draw from the
      generators the stages share, a loader whose order is not deterministic.

    Attributes:
        args: ``(message,)``: the loop or step (``"epoch 0, training batch 17"``), each process's fingerprint (and,
            for datasets, their sizes), the likely causes and the fix.
    """


def fingerprint(batch: Any) -> int:
    """A 63-bit digest of ``batch`` that any difference in its rows' order or content changes almost surely.

    Every tensor leaf of the (nested) batch contributes its dtype, its shape and :data:`_COLUMNS` evenly spaced
    values of each row along dim 0 (all of a 0-d tensor); strings and numbers contribute their value; other
    objects their type only (their ``repr`` may hold a memory address). Cost: one gather of ``rows x 16`` values
    per tensor and a hash of their bytes (a device-to-host copy of those values on an accelerator).
    """
    digest = hashlib.blake2b(digest_size=8)
    leaves, spec = tree_flatten(batch)
    digest.update(repr(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(_sample(leaf))
        else:
            digest.update(repr(leaf if isinstance(leaf, _PLAIN) else type(leaf)).encode())
    return int.from_bytes(digest.digest(), "big") >> 1


def _sample(tensor: Tensor) -> bytes:
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return b""
    rows = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
    width = rows.shape[1]
    columns = torch.linspace(0, width - 1, min(_COLUMNS, width), device=rows.device).long()
    return rows.index_select(1, columns).cpu().contiguous().view(torch.uint8).numpy().tobytes()


class StepAgreement:
    """One all-reduce before each step: compare the pipeline's batch fingerprints and share stop requests.

    Args:
        replica: this process's data-parallel rank.
        replicas: the number of pipeline replicas.
        device: where the reduced tensor lives (the process group's device).
        names: global rank -> name in messages (``"stage 0"``).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the collectives use.
    """

    def __init__(self, replica: int, replicas: int, device: torch.device, names: dict[int, str], job: "Job") -> None:
        self.replica, self.replicas, self.device, self.names, self.job = replica, replicas, device, names, job

    def agree(self, batch: Any, requests: Sequence[bool], where: Callable[[], str]) -> list[bool]:
        """Compare this step's batch with the other stages' and combine the stop requests (a collective call of
        every process, with the same number of ``requests``).

        Args:
            batch: the batch this process is about to run.
            requests: this process's flags (e.g. "a SIGTERM arrived"); the result holds each flag's OR over all
                processes.
            where: the step's position for the error, e.g. ``"epoch 2, training batch 17"``.

        Raises:
            BatchMismatchError: on every process, when the stages of a pipeline read different batches.
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        mine = fingerprint(batch)
        slots = torch.full((len(requests) + 2 * self.replicas,), _NEUTRAL, dtype=torch.int64)
        slots[: len(requests)] = torch.tensor([int(r) for r in requests], dtype=torch.int64)
        start = len(requests) + 2 * self.replica
        slots[start : start + 2] = torch.tensor([mine, -mine], dtype=torch.int64)
        reduced = slots.to(self.device)
        if dist.is_initialized():
            collectives.all_reduce(self.job, reduced, dist.ReduceOp.MAX)
        values = reduced.tolist()
        pairs = values[len(requests) :]
        if any(pairs[2 * r] != -pairs[2 * r + 1] for r in range(self.replicas)):
            self._mismatch(mine, where())
        return [bool(value) for value in values[: len(requests)]]

    def _mismatch(self, mine: int, where: str) -> None:
        """Raise :class:`BatchMismatchError` naming every process's fingerprint (a collective call)."""
        every = collectives.all_gather_object(self.job, mine) if dist.is_initialized() else [mine]
        read = ", ".join(f"{self.names.get(rank, f'rank {rank}')}: {value:016x}" for rank, value in enumerate(every))
        raise BatchMismatchError(
            f"The stages of a pipeline read different batches at {where} (batch fingerprints {read}). The last stage"
            " would pair the first stage's rows with other rows' labels. Every stage must read the same batch:"
            " likely causes are a sampler or shuffle that draws its order from each process's own random generator"
            " (keep Trainer(use_distributed_sampler=True), or seed the sampler's generator alike on every process),"
            " random augmentation that does not draw from torch, NumPy or Python's global generators (seed it"
            " alike on every stage, or move it into the model after the backbone input is made), or a loader whose"
            " order is not deterministic (an iterable dataset reading a stream, worker processes returning batches"
            " out of order)."
        )


def same_batch_counts(loop: str, counts: list, job: "Job") -> None:
    """Raise on every process alike when the processes' loaders have different numbers of batches for ``loop``
    (``"training"``, ``"validation"``...): a stage with fewer would stop while the others wait for it. ``counts``:
    this process's batches per loader; ``job``: the run's :class:`~lightning_gpipe.faults.job.Job` (its waits, and the
    processes' names). A collective call.

    Raises:
        ValueError: naming each process's number of batches.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    every = collectives.all_gather_object(job, counts) if dist.is_initialized() else [counts]
    if any(other != every[0] for other in every):
        per_stage = ", ".join(f"{job.watchdog.name_of(rank)}: {n}" for rank, n in enumerate(every))
        raise ValueError(
            f"The stages have different numbers of {loop} batches ({per_stage}); every stage runs every batch"
            " of the pipeline, so all stages need the same data loaders: the same dataset length, batch size,"
            " `drop_last` and sampler on every process."
        )
