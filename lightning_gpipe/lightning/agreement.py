"""The stages' agreement in each step: did they read the same batch, and does any of them ask to stop?

The stages of a pipeline each read the batch from their own data loader: the first feeds its rows to the
backbone, the last pairs the backbone's output with its labels. If the loaders diverge (a sampler drawing from
each process's own random generator, random augmentation on the data path, a non-deterministic loader), the
model trains on inputs paired with other rows' labels, and nothing fails. So in each step the processes
all-reduce one small CPU tensor: a fingerprint of each replica's batch (:func:`fingerprint`, computed from the batch
on the host before it is moved to the device, with tensor operations: no value is read on the host) and the stop
requests (a SIGTERM, SLURM's requeue signal) that must take effect on every process at the same step. A fingerprint
that differs between the stages of a pipeline stops the job on every process with :class:`BatchMismatchError`,
naming the batch.

The tensor holds, for each data-parallel replica, the maximum of its stages' fingerprints and the maximum of
their negations (equal stages: ``max == -max(-x)``), for each request the maximum of the processes' flags, and in
training a region of :data:`REGION_WORDS` words per replica that its last stage fills (the logging relay's
description of the step, :class:`~lightning_gpipe.lightning.relay.StepRelay`); slots of other replicas and
processes hold the reduction's neutral element. It is reduced on the run's CPU (gloo) group, and read on the host
once: in training at the end of ``backward``, before the optimizer step, so a mismatch still stops every stage
before the weights change; in evaluation before the step.

Signals that stop or requeue a job are taken at a step that every process agrees on (:class:`StopSignals`). A signal
reaches each stage process at a different point of its step: one in its fill, another in a transfer
or an optimizer step. Lightning acts on SIGTERM and SLURM's requeue signal where they land: its SIGTERM handler
broadcasts from rank 0 inside the handler (which can pair with another stage's collective), marks the trainer,
and its loop then checks the mark locally at the end of every batch, so a stage that is a step ahead of the
others stops one step later than they do; its requeue handler saves a checkpoint inside the handler. Here a
handler only marks the request; the marks travel with the stages' agreement before each step
(:class:`StepAgreement`), and every process acts on the agreed requests at the same point
(:meth:`StopSignals.act`): SIGTERM sets Lightning's mark on every process at once, so its loop ends
every stage after the same step; a requeue saves Lightning's HPC checkpoint on every stage and requeues the job.

SIGINT must end the job even where the process inherited it ignored (a background job of a non-interactive
shell ignores it, so ``kill -INT`` would do nothing): during a run it raises ``KeyboardInterrupt`` in the main
thread, which Lightning turns into a shutdown that ends every stage process.
"""

import functools
import hashlib
import signal
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_gpipe._torch import tree_flatten
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import mark_sigterm, original_signal_handler, requeue

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job

NEUTRAL = torch.iinfo(torch.int64).min
"""The maximum's neutral element: what a process puts in the slots it does not own."""

REGION_WORDS = 1024
"""int64 words of each replica's relay region in a training step's all-reduce (8 KiB; a larger description goes in a
broadcast of its own)."""

_COLUMNS = 16
"""Values of each row of a tensor that go into a fingerprint, evenly spaced over the row."""

_MASK = (1 << 62) - 1
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


def fingerprint(batch: Any) -> Tensor:
    """A 62-bit digest of ``batch`` (a 0-d int64 CPU tensor) that any difference in its rows' order or content
    changes almost surely, made with tensor operations: no tensor value is read on the host.

    Every tensor leaf of the (nested) batch contributes its dtype, its shape and the bytes of :data:`_COLUMNS`
    evenly spaced values of each row along dim 0 (all of a 0-d tensor), each byte times a fixed odd 62-bit number
    of its position, summed modulo 2^64 (a change of one byte always changes the sum); strings and numbers
    contribute their value; other objects their type only (their ``repr`` may hold a memory address). Cost: one
    gather of ``rows x 16`` values per tensor. A tensor already on an accelerator (a loader that yields device
    tensors) costs a device-to-host copy of the sum.
    """
    leaves, spec = tree_flatten(batch)
    digest, parts = hashlib.blake2b(repr(spec).encode(), digest_size=8), []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            parts.append(_sampled_bytes(leaf))
        else:
            digest.update(repr(leaf if isinstance(leaf, _PLAIN) else type(leaf)).encode())
    total = torch.tensor(int.from_bytes(digest.digest(), "big") & _MASK, dtype=torch.int64)
    for part in (part for part in parts if part.numel()):
        weights = _weights(part.numel(), part.device)
        total = total * 31 + (part.to(torch.int64) * weights).sum().to("cpu")
    return total & _MASK


def _sampled_bytes(tensor: Tensor) -> Tensor:
    """The bytes of :data:`_COLUMNS` evenly spaced values of each row of ``tensor``, as one uint8 vector."""
    if tensor.layout != torch.strided or tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    rows = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
    sampled = rows.index_select(1, _columns(rows.shape[1], rows.device)).contiguous()
    return sampled.view(torch.uint8).reshape(-1)


@functools.lru_cache(maxsize=64)
def _columns(width: int, device: torch.device) -> Tensor:
    return torch.linspace(0, width - 1, min(_COLUMNS, width), device=device).long()


@functools.lru_cache(maxsize=64)
def _weights(length: int, device: torch.device) -> Tensor:
    """``length`` fixed odd 62-bit numbers, one per byte position (the same on every process)."""
    generator = torch.Generator().manual_seed(0x6770697065)
    return (torch.randint(0, 1 << 62, (length,), generator=generator, dtype=torch.int64) | 1).to(device)


class StepAgreement:
    """One all-reduce per step on the CPU group: compare the pipeline's batch fingerprints, share stop requests and,
    in training, each replica's relay region (see the module docstring).

    Args:
        replica: this process's data-parallel rank.
        replicas: the number of pipeline replicas.
        names: global rank -> name in messages (``"stage 0"``).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the collectives use.
        group: the CPU (gloo) process group of every process (``None``: the default group, a gloo one).
    """

    def __init__(
        self, replica: int, replicas: int, names: dict[int, str], job: "Job", group: Any | None = None
    ) -> None:
        self.replica, self.replicas, self.names, self.job, self.group = replica, replicas, names, job, group

    def agree(
        self,
        fingerprint: Tensor,
        requests: Sequence[bool],
        where: Callable[[], str],
        relay: Tensor | None = None,
    ) -> tuple[list[bool], np.ndarray]:
        """Compare this step's batch with the other stages' and combine the stop requests (a collective call of
        every process, with the same number of ``requests`` and alike ``relay`` or not): one all-reduce and one
        host read of its result.

        Args:
            fingerprint: this process's batch's :func:`fingerprint`.
            requests: this process's flags (e.g. "a SIGTERM arrived"); the result holds each flag's OR over all
                processes.
            where: the step's position for the error, e.g. ``"epoch 2, training batch 17"``.
            relay: in training, this process's int64 words for its replica's relay region, a CPU tensor (the last
                stage's; none on the others); ``None`` (evaluation): no region.

        Returns:
            The agreed requests, and this replica's relay region (:data:`REGION_WORDS` words; none without
            ``relay``), its unfilled words :data:`NEUTRAL`.

        Raises:
            BatchMismatchError: on every process, when the stages of a pipeline read different batches.
            ValueError: if ``relay`` is longer than :data:`REGION_WORDS`.
            PipelineFailure: if another process failed or stalled while this one waited for it.
        """
        words = 0 if relay is None else REGION_WORDS
        if relay is not None and len(relay) > words:
            raise ValueError(f"A relay region holds {words} words, not {len(relay)}.")
        mine = fingerprint.reshape(1)
        own = torch.cat([mine, -mine])
        slots = torch.full((len(requests) + (2 + words) * self.replicas,), NEUTRAL, dtype=torch.int64)
        slots[: len(requests)] = torch.tensor([int(r) for r in requests], dtype=torch.int64)
        start = len(requests) + (2 + words) * self.replica
        slots[start : start + 2] = own
        if relay is not None and len(relay):
            slots[start + 2 : start + 2 + len(relay)] = relay
        if dist.is_initialized():
            waiting.all_reduce(self.job, slots, dist.ReduceOp.MAX, group=self.group)
        values = slots.numpy()  # the one host read of the step's agreement
        offsets = [len(requests) + (2 + words) * r for r in range(self.replicas)]
        if any(values[o] != -values[o + 1] for o in offsets):
            self._mismatch(fingerprint, where())
        return [bool(value) for value in values[: len(requests)]], values[start + 2 : start + 2 + words].copy()

    def _mismatch(self, fingerprint: Tensor, where: str) -> None:
        """Raise :class:`BatchMismatchError` naming every process's fingerprint (a collective call)."""
        mine = int(fingerprint)
        every = waiting.all_gather_object(self.job, mine) if dist.is_initialized() else [mine]
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
    every = waiting.all_gather_object(job, counts) if dist.is_initialized() else [counts]
    if any(other != every[0] for other in every):
        per_stage = ", ".join(f"{job.watchdog.name_of(rank)}: {n}" for rank, n in enumerate(every))
        raise ValueError(
            f"The stages have different numbers of {loop} batches ({per_stage}); every stage runs every batch"
            " of the pipeline, so all stages need the same data loaders: the same dataset length, batch size,"
            " `drop_last` and sampler on every process."
        )


SIGTERM, REQUEUE = 0, 1
"""Indices of the requests in :meth:`StopSignals.requests`."""


class StopSignals:
    """Marks SIGTERM and SLURM's requeue signal, and acts on them once the processes agree (see the module
    docstring). One per run; handlers are installed in the main thread only.

    Args:
        trainer: the running Trainer (its signal connector holds Lightning's SIGTERM mark and requeue handler).
        launcher: the strategy's launcher, which forwards a SIGTERM to the processes it started.
        environment: the cluster environment; under ``SLURMEnvironment(auto_requeue=True)`` the requeue signal is
            handled too.
    """

    def __init__(self, trainer: "pl.Trainer", launcher: Any | None, environment: Any | None) -> None:
        self.trainer, self.launcher = trainer, launcher
        self.marks = [False, False]
        requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        slurm = cast(SLURMEnvironment, environment)  # when ``requeue``: checked by the isinstance above
        self.requeue_signal: signal.Signals | None = slurm.requeue_signal if requeue else None

    def install(self) -> None:
        """Replace Lightning's SIGTERM and requeue handlers by marking ones, and let SIGINT raise
        ``KeyboardInterrupt`` (Lightning's signal connector restores every handler when the run ends)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        previous = original_signal_handler(self.trainer, signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if not self.marks[SIGTERM] and self.launcher is not None:
                self.launcher.kill(signum)  # the processes it started get the signal too, as with Lightning's
            self.marks[SIGTERM] = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        if self.requeue_signal is not None and original_signal_handler(self.trainer, self.requeue_signal) in (
            None,
            signal.SIG_DFL,
        ):  # Lightning leaves a handler of the user's in place, and so do we
            signal.signal(self.requeue_signal, lambda signum, frame: self._mark(REQUEUE))
        else:
            self.requeue_signal = None

    def _mark(self, request: int) -> None:
        self.marks[request] = True

    def requests(self) -> list[bool]:
        """This process's marks, in the order of :data:`SIGTERM` and :data:`REQUEUE`, for the agreement."""
        return list(self.marks)

    def act(self, agreed: list[bool], training: bool) -> None:
        """Act on the requests agreed by every process (the same call on every process, at the same step).

        A SIGTERM sets Lightning's mark, so that its loops stop every stage at the end of this batch. A requeue
        (in training only; it stays pending during evaluation) saves Lightning's HPC checkpoint on every stage,
        has global rank 0 run ``scontrol requeue`` (Lightning's own handler), and ends every stage.

        Raises:
            SIGTERMException: after a requeue's checkpoint, as SLURM's SIGTERM after the requeue would end the job.
        """
        if agreed[SIGTERM]:
            self.marks[SIGTERM] = True
            mark_sigterm(self.trainer)
        if agreed[REQUEUE] and training and self.requeue_signal is not None:
            # every stage names the file before any writes it (the save starts with collectives): the same path
            requeue(self.trainer, self.requeue_signal)
            rank_zero_info("Saved the checkpoint and requeued the job; ending every stage.")
            raise SIGTERMException


class RunAgreement:
    """What a run's processes agree on at each step (see the module docstring): the batch each read (its
    :func:`fingerprint`, taken as the batch moves to the device: :meth:`take`) and the stop requests, which take
    effect at a step boundary every process shares. One per run, made at the strategy's ``setup_environment``.

    Args:
        agreement: the step's all-reduce (``None``: a run of one process, which agrees with itself).
        signals: the run's :class:`StopSignals`.
    """

    def __init__(self, agreement: StepAgreement | None, signals: StopSignals) -> None:
        self.agreement, self.signals = agreement, signals
        self.fingerprint = torch.zeros((), dtype=torch.int64)  # of the batch this process is about to run
        self._agreed: list[bool] | None = None  # the stop requests agreed in the last training step
        self._batch_name = ""

    def take(self, batch: Any) -> None:
        """Keep the :func:`fingerprint` of ``batch``, the one this process is about to run (several processes only)."""
        if self.agreement is not None:
            self.fingerprint = fingerprint(batch)

    def begin_training_step(self, batch_idx: int) -> None:
        """At the start of training batch ``batch_idx``: act on the stop requests the processes agreed on in the
        last step (:meth:`end_training_step`), at this step boundary, on every process alike (one process: on its
        own requests)."""
        self._batch_name = f"training batch {batch_idx}"
        requests, self._agreed = self._agreed, None
        if self.agreement is None:
            requests = self.signals.requests()
        if requests is not None:
            self.signals.act(requests, training=True)

    def end_training_step(self, epoch: int, relay: Tensor | None) -> np.ndarray:
        """The agreement of one training step of epoch ``epoch``, at the end of its ``backward`` (one all-reduce on
        the CPU group, :meth:`StepAgreement.agree`): the stages of each pipeline must have read the same batch, and
        a SIGTERM or requeue signal that reached any process takes effect on all of them at the next step boundary
        (:meth:`begin_training_step`); ``relay``: this process's words of its replica's relay region (``None``: no
        region, a pipeline of one stage). Returns the region (nothing with one process).

        Raises:
            BatchMismatchError: on every process, if the stages of a pipeline read different batches.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self.agreement is None:
            return np.empty(0, dtype=np.int64)
        where = lambda: f"epoch {epoch}, {self._batch_name}"  # noqa: E731
        self._agreed, region = self.agreement.agree(self.fingerprint, self.signals.requests(), where, relay)
        return region

    def before_step(self, epoch: int, which: str, training: bool = False) -> None:
        """The agreement before one evaluation step of epoch ``epoch`` (one all-reduce): the stages of each
        pipeline must have read the same batch (``which`` names it), and a stop request that reached any process
        takes effect on all of them at this step (:meth:`StopSignals.act`; a requeue in training only).

        Raises:
            BatchMismatchError: on every process, if the stages of a pipeline read different batches.
            SIGTERMException: after a SLURM requeue's checkpoint.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self.agreement is None:
            return
        agreed, _ = self.agreement.agree(self.fingerprint, self.signals.requests(), lambda: f"epoch {epoch}, {which}")
        self.signals.act(agreed, training)
