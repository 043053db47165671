"""What the pipeline callbacks share: recording each training step on every stage and gathering it on rank 0.

Every stage process runs the same callbacks, so each hook runs on every stage. While a training batch
runs, the stage's :class:`~lightning_gpipe.engine.events.Recorder` is on; at the batch's end, the stage's spans
become a :class:`~lightning_gpipe.engine.trace.StageTrace` and, for the steps some callback asks for, every stage
sends its trace to global rank 0 (:func:`lightning_gpipe.faults.waiting.gather_object`, one collective per step
whatever the number of callbacks asking). With several data-parallel replicas, the traces are replica 0's
pipeline's (the replicas run the same schedule). Under a strategy other than ``GPipeStrategy`` the callbacks do
nothing.

Clocks: spans are ``time.perf_counter()`` seconds, one clock per machine. The traces of stages on another node
than global rank 0 are moved onto rank 0's clock by the offset of the two clocks, measured once when the
pipeline's stages leave a barrier together (to within the barrier's latency, well under a millisecond on one
network).
"""

import os
import socket
import time
from abc import ABC, abstractmethod
from typing import Any, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_gpipe.engine import StageTrace, StepTrace
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning.strategy import GPipeStrategy


class _Collector:
    """Records the training steps of one stage and gathers them; shared by all pipeline callbacks of a run."""

    def __init__(self, strategy: GPipeStrategy) -> None:
        assert strategy.run is not None  # made during a run (PipelineCallback._collector)
        self.strategy, self.run = strategy, strategy.run
        self.batch: int | None = None
        self.start = 0.0
        self.optimizer_start: float | None = None
        self.local: StageTrace | None = None
        self.gathered: tuple[int | None, StepTrace | None] = (None, None)
        self.clock: float | None = None  # perf_counter() when the pipeline's stages left a barrier together

    def batch_start(self, batch: int, memory: bool) -> None:
        events = self.run.events
        if batch == self.batch:
            events.memory = events.memory or memory
            return
        self.batch, self.local, self.optimizer_start = batch, None, None
        events.take()
        events.enabled, events.memory = True, memory
        self.start = time.perf_counter()

    def before_optimizer_step(self) -> None:
        if self.optimizer_start is None:
            self.optimizer_start = time.perf_counter()

    def batch_end(self) -> StageTrace:
        if self.local is None:
            end, events = time.perf_counter(), self.run.events
            if self.optimizer_start is not None:
                events.add("optimizer", None, self.optimizer_start, end)
            events.enabled = False
            partition = self.run.partition
            parameters = sum(p.numel() for p in partition.parameters())
            layers = sum(1 for _ in partition.children())
            self.local = StageTrace(self.strategy.stage_index, events.take(), self.start, end, layers, parameters)
        return self.local

    def gather(self) -> StepTrace | None:
        """The whole pipeline's trace of this batch on global rank 0, ``None`` elsewhere (a collective call of replica
        0's pipeline; the other replicas return ``None`` at once).

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self.strategy.replica_index != 0:
            return None
        if self.gathered[0] != self.batch:
            group = self.strategy.pipeline_group
            if self.clock is None:
                waiting.barrier(self.strategy.job, group)
                self.clock = time.perf_counter()
            assert self.batch is not None  # gathered after batch_start
            mine = (self.batch_end(), self.clock, socket.gethostname())
            parts = waiting.gather_object(self.strategy.job, mine, dst=0, group=group)
            step = StepTrace(self.batch, _on_one_clock(parts)) if parts is not None else None
            self.gathered = (self.batch, step)
        return self.gathered[1]


def _on_one_clock(parts: list[tuple[StageTrace, float, str]]) -> list[StageTrace]:
    """The stages' traces in stage order, those of other hosts than the first part's moved onto its clock."""
    _, clock, host = parts[0]
    moved = [trace if node == host else trace.shifted(clock - theirs) for trace, theirs, node in parts]
    return sorted(moved, key=lambda s: s.stage)


class PipelineCallback(pl.Callback, ABC):
    """Base of the pipeline callbacks: records the training steps and hands gathered steps to :meth:`on_step`.

    Subclasses say which steps they want (:meth:`wants`) and receive them on global rank 0; with
    :attr:`counts_memory`, those steps also count activation memory.
    """

    counts_memory = False

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Warn once when the strategy is not ``GPipeStrategy``: the callback then does nothing."""
        if not isinstance(trainer.strategy, GPipeStrategy):
            rank_zero_warn(
                f"{type(self).__name__} measures the stages of GPipeStrategy; under"
                f" {type(trainer.strategy).__name__} it does nothing."
            )

    def _collector(self, trainer: "pl.Trainer") -> _Collector | None:
        """The run's recorder of its steps, shared by every pipeline callback (kept on the run)."""
        run = trainer.strategy.run if isinstance(trainer.strategy, GPipeStrategy) else None
        if run is None:
            return None
        if run.collector is None:
            run.collector = _Collector(cast(GPipeStrategy, trainer.strategy))  # a run: a GPipeStrategy
        return run.collector

    @override
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, *_: Any) -> None:
        """Start recording this batch (once per batch, whichever pipeline callback comes first)."""
        collector = self._collector(trainer)
        if collector is not None:
            batch = trainer.fit_loop.total_batch_idx
            collector.batch_start(batch, memory=self.counts_memory and self.wants(batch))

    @override
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer) -> None:
        """Mark the start of the optimizer step."""
        collector = self._collector(trainer)
        if collector is not None:
            collector.before_optimizer_step()

    @override
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *_: Any) -> None:
        """Close this batch's trace; gather the pipeline's if :meth:`wants` it, and pass it to :meth:`on_step`."""
        collector = self._collector(trainer)
        if collector is None:
            return
        collector.batch_end()
        assert collector.batch is not None  # on_train_batch_start came first
        if self.wants(collector.batch):
            step = collector.gather()
            if step is not None:
                self.on_step(trainer, step)

    @abstractmethod
    def wants(self, batch: int) -> bool:
        """Whether to gather training batch ``batch`` (``trainer.fit_loop.total_batch_idx``); the same on every rank."""

    @abstractmethod
    def on_step(self, trainer: "pl.Trainer", step: StepTrace) -> None:
        """Called on global rank 0 with each gathered step."""


def log_dir(trainer: "pl.Trainer") -> str:
    """Where the callbacks write: the first logger's ``log_dir`` (else its ``save_dir``), else ``default_root_dir``.

    Unlike ``trainer.log_dir`` this is no collective call, so rank 0 may call it alone.
    """
    logger = trainer.logger
    path = (getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)) if logger is not None else None
    path = path or trainer.default_root_dir
    os.makedirs(path, exist_ok=True)
    return path


def log_metrics(trainer: "pl.Trainer", metrics: dict[str, float]) -> None:
    """Send ``metrics`` to every logger of the trainer at the current global step."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
