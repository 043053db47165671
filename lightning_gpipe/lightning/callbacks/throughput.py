"""PipelineThroughput: samples and items per second of the pipeline, its bubble and each stage's efficiency."""

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput
from typing_extensions import override

from lightning_gpipe.engine import StepTrace
from lightning_gpipe.lightning.callbacks._pipeline import PipelineCallback, log_metrics


def batch_rows(batch: Any) -> int:
    """Rows (dim 0) of the first tensor found in ``batch`` (a Tensor, or nested lists, tuples and dicts of them).

    Raises:
        ValueError: if ``batch`` holds no tensor.
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        try:
            return batch_rows(item)
        except ValueError:
            continue
    raise ValueError(f"Cannot count the samples of a {type(batch).__name__} batch; pass `batch_size_fn`.")


class PipelineThroughput(PipelineCallback):
    """Training throughput of the pipeline, with its bubble and the efficiency of each stage.

    Built on Lightning's :class:`lightning.fabric.utilities.throughput.Throughput`, like
    :class:`lightning.pytorch.callbacks.ThroughputMonitor`, with two differences a pipeline needs: the K
    stage processes work on the *same* samples, so the throughput is counted once per pipeline (Lightning's
    ``device/`` metrics here mean one pipeline, not one process), and every stage's spans are gathered each
    step (one small collective per step) to measure:

    - ``pipeline/bubble``: the mean share of the step the stages are not busy (see :mod:`lightning_gpipe.engine.trace`);
    - ``pipeline/bubble_ideal``: the schedule's bubble with equal stages and free transfers, ``(K - 1) / (M + K - 1)``
      (GPipe, section 2.2), beside the measured one: the gap is imbalance, transfers and per-step overhead;
    - ``pipeline/efficiency/stage{k}``: stage k's busy time (forward, recompute, backward, weight, loss,
      optimizer) over the step's wall time.

    Both are averaged over the last ``window_size`` steps. Logged on global rank 0 every
    ``trainer.log_every_n_steps`` training batches, with Lightning's throughput metrics under ``throughput/``
    (``throughput/device/samples_per_sec``, ``throughput/device/items_per_sec`` with ``length_fn``...), which
    appear once ``window_size`` steps have run. Validation inside ``fit`` is left out of the time.

    Args:
        batch_size_fn: samples in a batch; default :func:`batch_rows` (dim 0 of the batch's first tensor).
        length_fn: items in a batch, e.g. tokens for text: ``lambda batch: batch["input_ids"].numel()``;
            ``None`` (default): no items metric.
        window_size: steps the rates and shares are averaged over (default 10; Lightning's default is 100).
        **kwargs: passed to ``Throughput`` (``separator``).
    """

    def __init__(
        self,
        batch_size_fn: Callable[[Any], int] = batch_rows,
        length_fn: Callable[[Any], int] | None = None,
        window_size: int = 10,
        **kwargs: Any,
    ) -> None:
        self.batch_size_fn, self.length_fn = batch_size_fn, length_fn
        self.window_size, self.kwargs = window_size, kwargs
        self.throughput: Throughput | None = None
        self.metrics: dict[str, float] = {}
        self._t0 = 0.0
        self._paused: float | None = None  # when validation inside `fit` started
        self._totals = {"batches": 0, "samples": 0, "lengths": 0}
        self._shares: deque[tuple[float, list[float]]] = deque(maxlen=window_size)  # (wall, busy per stage)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start counting."""
        replicas = trainer.strategy.topology.data_parallel_size if hasattr(trainer.strategy, "topology") else 1
        self.throughput = Throughput(world_size=replicas, window_size=self.window_size, **self.kwargs)
        self._totals = dict.fromkeys(self._totals, 0)
        self._shares.clear()
        self._t0 = time.perf_counter()

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Pause the clock: validation inside ``fit`` is not training time (as in ``ThroughputMonitor``)."""
        self._paused = time.perf_counter()

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Resume the clock."""
        if self._paused is not None:
            self._t0 += time.perf_counter() - self._paused
            self._paused = None

    @override
    def wants(self, batch: int) -> bool:
        """Every step."""
        return True

    @torch.inference_mode()
    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch's samples, then gather the step (see :class:`PipelineCallback`)."""
        self._totals["batches"] += 1
        self._totals["samples"] += self.batch_size_fn(batch)
        if self.length_fn is not None:
            self._totals["lengths"] += self.length_fn(batch)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_step(self, trainer: "pl.Trainer", step: StepTrace) -> None:
        """Update the throughput and the shares; log them every ``log_every_n_steps`` batches."""
        assert self.throughput is not None  # made by on_train_start
        self.throughput.update(
            time=time.perf_counter() - self._t0,
            batches=self._totals["batches"],
            samples=self._totals["samples"],
            lengths=self._totals["lengths"] if self.length_fn is not None else None,
        )
        self._shares.append((step.wall, [s.busy for s in step.stages]))
        if (step.step + 1) % trainer.log_every_n_steps:  # type: ignore[attr-defined]  # set by Lightning, undeclared
            return
        wall = sum(w for w, _ in self._shares)
        efficiency = [sum(busy[k] for _, busy in self._shares) / wall for k in range(len(step.stages))]
        self.metrics = {f"throughput/{name}": value for name, value in self.throughput.compute().items()}
        self.metrics["pipeline/bubble"] = 1 - sum(efficiency) / len(efficiency)
        stages, micro_batches = len(step.stages), max(step.micro_batches, 1)
        self.metrics["pipeline/bubble_ideal"] = (stages - 1) / (micro_batches + stages - 1)
        self.metrics.update({f"pipeline/efficiency/stage{k}": e for k, e in enumerate(efficiency)})
        log_metrics(trainer, self.metrics)
