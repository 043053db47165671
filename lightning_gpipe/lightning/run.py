"""This process's stage for one run: its part of the pipeline (the engine's door) and what Lightning adds to it.

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

from lightning_gpipe.engine import Partition, Recorder, StagePipeline, StepGradients, TiedParameters, materialize
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning import state_dict
from lightning_gpipe.lightning.contract import BackboneCall
from lightning_gpipe.lightning.data_parallel import GradientSync, ShardedStage
from lightning_gpipe.lightning.randomness import StageRandomness
from lightning_gpipe.lightning.relay import LogRelay, StepRelay


@dataclass
class StageRun:
    """This process's part of one run (see the module docstring).

    Args:
        pipeline: this process's part of the pipeline (the engine's door).
        backbone_call: the call the partition goes through (installed as ``partition.backbone_call``).
        relay: copies the last stage's logged values to every stage (evaluation steps, epoch-end hooks).
        step_relay: the last stage's logged values and output in training steps.
        randomness: the stage's random streams (see :mod:`lightning_gpipe.lightning.randomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (failure board, position, watchdog, waits).
        gradient_sync: DDP over the stage's replicas, with several of them (set by :meth:`sync_gradients`).
        sharded: FSDP2 over the stage's replicas instead, with a ``sharding_strategy`` (set by :meth:`sync_gradients`).
        step_gradients: a 1F1B step's gradients, kept apart until Lightning's ``backward``.
        collector: what the pipeline callbacks (:mod:`lightning_gpipe.lightning.callbacks`) record of this run's steps,
            shared by all of them; the first one that needs it sets it.
    """

    pipeline: StagePipeline
    backbone_call: BackboneCall
    relay: LogRelay
    step_relay: StepRelay
    randomness: StageRandomness
    share: Callable[[Any], Any]
    job: Job
    gradient_sync: GradientSync | None = None
    sharded: ShardedStage | None = None
    step_gradients: StepGradients = field(default_factory=StepGradients)
    collector: Any = None

    @property
    def partition(self) -> Partition:
        """Every backbone layer this stage holds, under its original names (all its model chunks')."""
        return self.pipeline.partition

    @property
    def ties(self) -> TiedParameters:
        """The parameters this stage shares with others."""
        return self.pipeline.ties

    @property
    def events(self) -> Recorder:
        """The stage's recorder, which every model chunk's spans go to (marked with their model chunk)."""
        return self.pipeline.events

    def sync_gradients(
        self, module: "pl.LightningModule", group: Any, device: torch.device, sharding: str = "NO_SHARD"
    ) -> None:
        """Let DDP average this stage's gradients over its data-parallel ``group`` (several replicas only; see
        :mod:`lightning_gpipe.lightning.data_parallel`): what the stage trains is its partition, and on the last stage
        also the modules after the backbone. The sync starts at the step's last backward on the stage
        (:meth:`~lightning_gpipe.engine.StagePipeline.on_last_backward`); the other model chunks' parameters are
        complete by then, and DDP reduces them with the first bucket. With a ``sharding`` other than ``"NO_SHARD"``,
        FSDP2 shards what the stage holds over ``group`` instead (:class:`~lightning_gpipe.lightning.data_parallel.
        ShardedStage`), keeping the gathered parameters from the stage's first backward of a step
        (:meth:`~lightning_gpipe.engine.StagePipeline.on_backward_start`) to its end. A collective call of ``group``."""
        trained = module if self.pipeline.is_last else self.partition
        if sharding != "NO_SHARD":
            if any(True for _ in trained.parameters()):
                full = sharding == "FULL_SHARD"
                self.sharded = ShardedStage(trained, self.pipeline.partitions, group, device, full, self.job)
                self.pipeline.on_backward_start(self.sharded.begin_backward)
            return
        if not GradientSync.trains(trained):
            return
        self.gradient_sync = GradientSync(trained, group, device)
        if GradientSync.trains(self.partition):
            self.pipeline.on_last_backward(self.gradient_sync.prepare)

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
        averages. With sharding, FSDP2 keeps the window's gradients unsharded apart from ``.grad`` under every plan,
        and reduce-scatters them once, at the window's end."""
        sync = self.gradient_sync
        if self.sharded is not None:  # FSDP2 keeps the window's gradients to itself, whatever the plan
            with self.sharded.disabled():
                yield
            return
        with nullcontext() if sync is None or self.pipeline.loss_per_micro_batch else sync.disabled():
            yield

    def announce_loss_backward(self, loss: Tensor) -> None:
        """On the last stage, announce the step's last backward to the gradient sync when it is the loss's
        (:attr:`~lightning_gpipe.engine.StagePipeline.loss_ends_backward`)."""
        if self.gradient_sync is not None and self.pipeline.loss_ends_backward:
            self.gradient_sync.prepare([loss])

    def begin_step(self) -> None:
        """At the start of a step (training or evaluation), with sharding: gather what FSDP2 does not gather in the
        micro-batches (see :meth:`~lightning_gpipe.lightning.data_parallel.ShardedStage.begin_step`)."""
        if self.sharded is not None:
            self.sharded.begin_step()

    def finish_backward(self) -> None:
        """At the end of a training step's backward, with sharding: the step's reduce-scatter (not within a
        gradient-accumulation window) and the gathered parameters freed (see
        :meth:`~lightning_gpipe.lightning.data_parallel.ShardedStage.finish_backward`)."""
        if self.sharded is not None:
            self.sharded.finish_backward()

    def end_evaluation_step(self) -> None:
        """After an evaluation step, with sharding: the gathered parameters freed."""
        if self.sharded is not None:
            self.sharded.end_evaluation_step()

    def unshard(self) -> None:
        """With sharding, after a completed fit: every parameter whole again and FSDP2 undone, so the module leaves
        the run plain (see :meth:`~lightning_gpipe.lightning.data_parallel.ShardedStage.release`). A collective call of
        the stage's replicas."""
        if self.sharded is not None:
            self.sharded.release()
            self.sharded = None

    def whole_state(self, module: "pl.LightningModule", replica: int, group: Any) -> dict | None:
        """Every stage's part of ``module``'s state on the process of pipeline replica ``replica`` that gets the
        whole model back (see :func:`~lightning_gpipe.lightning.state_dict.whole_on_rank_zero`; ``None`` elsewhere): a
        collective call over the pipeline's ``group``."""
        return state_dict.whole_on_rank_zero(module.state_dict(), replica, group, self.job)

    def close(self, module: "pl.LightningModule", whole: dict[str, Any] | None) -> None:
        """Undo the split (see :meth:`~lightning_gpipe.engine.StagePipeline.close`; ``whole``: every stage's state, on
        the process that gets the whole model back), the relay's hooks, and put back the shared random stream (if a
        step that failed kept the stage's)."""
        self.backbone_call.end_kept()
        LogRelay.unwrap_epoch_end_hooks(module)
        self.pipeline.close(whole)
