"""This process's stage for one run: the split module, its model chunks, their runtime and what goes with them.

:func:`~lightning_gpipe.lightning.build.build_stage` builds a :class:`StageRun` at the strategy's setup; it holds
what the strategy's hooks hand work to (a step's two protocols: :mod:`lightning_gpipe.lightning.step`), and
:meth:`StageRun.close` undoes the split at teardown.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_gpipe.engine.batchnorm import revert_deferred_batch_norm
from lightning_gpipe.engine.compilation import uncompile_layers
from lightning_gpipe.engine.contract import BackboneCall
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.gradients import StepGradients
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.partition import Partition, Split, materialize
from lightning_gpipe.engine.runtime import Runtime
from lightning_gpipe.engine.ties import TiedParameters
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning import state_dict
from lightning_gpipe.lightning.data_parallel import GradientSync
from lightning_gpipe.lightning.randomness import StageRandomness
from lightning_gpipe.lightning.relay import LogRelay, StepRelay


@dataclass
class StageRun:
    """This process's part of one run (see the module docstring).

    Args:
        split: the module split into this stage's partition.
        model_chunks: one :class:`~lightning_gpipe.engine.model_chunk.ModelChunk` per model chunk of the stage (one
            without virtual stages).
        runtime: executes the stage's plans.
        backbone_call: the call the partition goes through (installed as ``partition.backbone_call``).
        relay: copies the last stage's logged values to every stage (evaluation steps, epoch-end hooks).
        step_relay: the last stage's logged values and output in training steps.
        ties: the parameters this stage shares with others.
        randomness: the stage's random streams (see :mod:`lightning_gpipe.lightning.randomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (failure board, position, watchdog, waits).
        gradient_sync: DDP over the stage's replicas, with several of them (set by :meth:`sync_gradients`).
        step_gradients: a 1F1B step's gradients, kept apart until Lightning's ``backward``.
        collector: what the pipeline callbacks (:mod:`lightning_gpipe.lightning.callbacks`) record of this run's steps,
            shared by all of them; the first one that needs it sets it.
    """

    split: Split
    model_chunks: list[ModelChunk]
    runtime: Runtime
    backbone_call: BackboneCall
    relay: LogRelay
    step_relay: StepRelay
    ties: TiedParameters
    randomness: StageRandomness
    share: Callable[[Any], Any]
    job: Job
    gradient_sync: GradientSync | None = None
    step_gradients: StepGradients = field(default_factory=StepGradients)
    collector: Any = None

    @property
    def partition(self) -> Partition:
        """Every backbone layer this stage holds, under its original names (all its model chunks')."""
        return self.split.partition

    @property
    def events(self) -> Recorder:
        """The stage's recorder, which every model chunk's spans go to (marked with their model chunk)."""
        return self.model_chunks[0].events

    @property
    def last_chunk(self) -> ModelChunk:
        """The stage's last model chunk (its only one without virtual stages): on the last stage, the one whose
        output the user's step receives."""
        return self.model_chunks[-1]

    def sync_gradients(self, module: "pl.LightningModule", group: Any, device: torch.device) -> None:
        """Let DDP average this stage's gradients over its data-parallel ``group`` (several replicas only; see
        :mod:`lightning_gpipe.lightning.data_parallel`): what the stage trains is its partition, and on the last stage
        also the modules after the backbone. The step's last backward on the stage is its first model chunk's (every
        plan ends with it); the other model chunks' parameters are complete by then, and DDP reduces them with the
        first bucket."""
        trained = module if self.last_chunk.is_last else self.split.partition
        if not GradientSync.trains(trained):
            return
        self.gradient_sync = GradientSync(trained, group, device)
        if GradientSync.trains(self.split.partition):
            self.model_chunks[0].before_last_backward = self.gradient_sync.prepare

    def start(self, module: "pl.LightningModule", device: torch.device) -> None:
        """Initialise the stage's layers on ``device`` if ``module`` was created on the meta device (see
        :func:`~lightning_gpipe.engine.partition.materialize`), with the stage's random stream, and relay what the
        module's epoch-end hooks log. Once the run exists, so that :meth:`close` undoes the split if this fails.

        Raises:
            ValueError: if a layer created on the meta device cannot be initialised.
        """
        with self.randomness.stage():  # each stage initialises its own layers
            materialize(module, device)
        self.relay.relay_after_epoch_end_hooks(module)

    @contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Within a gradient-accumulation window, accumulate without averaging over the replicas (Lightning's loop
        enters this for every batch of the window but the last). Under a schedule with a loss per micro-batch (1F1B)
        every batch's gradients are averaged: they are computed apart from the window's earlier ones (see
        :class:`~lightning_gpipe.engine.gradients.StepGradients`), and the average of a sum is the sum of the
        averages."""
        sync = self.gradient_sync
        with nullcontext() if sync is None or self.runtime.loss_per_micro_batch else sync.disabled():
            yield

    def announce_loss_backward(self, loss: Tensor) -> None:
        """On the last stage, announce the step's last backward to the gradient sync when it is the loss's: the
        partition trains nothing, a one-stage pipeline runs the step unsplit (nothing left to drain), or the last
        micro-batch's loss backpropagates through the stage (:attr:`~lightning_gpipe.engine.model_chunk.ModelChunk.
        loss_completes_gradients`)."""
        sync = self.gradient_sync
        first = self.model_chunks[0]
        if sync is not None and (
            first.before_last_backward is None or not first.draining or first.loss_completes_gradients
        ):
            sync.prepare([loss])

    def whole_state(self, module: "pl.LightningModule", replica: int, group: Any) -> dict | None:
        """Every stage's part of ``module``'s state on the process of pipeline replica ``replica`` that gets the
        whole model back (see :func:`~lightning_gpipe.lightning.state_dict.whole_on_rank_zero`; ``None`` elsewhere): a
        collective call over the pipeline's ``group``."""
        return state_dict.whole_on_rank_zero(module.state_dict(), replica, group, self.job)

    def close(self, module: "pl.LightningModule", whole: dict[str, Any] | None) -> None:
        """Undo the split (see :meth:`~lightning_gpipe.engine.partition.Split.undo`; ``whole``: every stage's state, on
        the process that gets the whole model back), the relay's hooks, and put back the plain batch norm layers and
        the shared random stream (if a step that failed kept the stage's)."""
        self.backbone_call.end_kept()
        LogRelay.unwrap_epoch_end_hooks(module)
        uncompile_layers(self.split.partition)
        self.split.undo(whole)
        revert_deferred_batch_norm(self.split.sequential)
