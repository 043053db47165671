"""PipelineBalance: how the work is spread over the stages, and a better ``balance`` when it is uneven."""

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from itertools import product
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_gpipe.engine import TRANSFER, WORK, StepTrace, recomputed_share
from lightning_gpipe.lightning.callbacks._pipeline import PipelineCallback, log_dir, log_metrics
from lightning_gpipe.lightning.resplit import profile_errors, profile_line, profiled_busy
from lightning_gpipe.lightning.strategy import GPipeStrategy
from lightning_gpipe.planning import LayerCost, simulate, solve, stage_costs


@dataclass
class StageLoad:
    """One stage's mean cost per training step (all micro-batches together).

    Args:
        stage: pipeline rank.
        layers: backbone layers of the stage.
        parameters: parameter elements of those layers.
        forward: seconds per step of forwards.
        recompute: seconds per step of re-materializations.
        backward: seconds per step of backwards (deferred weight gradients included).
        loss: seconds per step of the last stage's head and loss (0 elsewhere).
        waiting: seconds per step blocked on a transfer.
        activation_bytes: peak bytes of kept inputs and saved activations in a step.
    """

    stage: int
    layers: int
    parameters: int
    forward: float
    recompute: float
    backward: float
    loss: float
    waiting: float
    activation_bytes: int

    @property
    def work(self) -> float:
        """Seconds of computing per step: forward, recompute, backward and loss."""
        return self.forward + self.recompute + self.backward + self.loss


def stage_loads(steps: Sequence[StepTrace]) -> list[StageLoad]:
    """The mean :class:`StageLoad` of every stage over ``steps`` (peak memory: the maximum)."""
    loads = []
    for k, first in enumerate(steps[0].stages):
        traces = [step.stages[k] for step in steps]
        mean = {kind: sum(t.total(kind) for t in traces) / len(traces) for kind in (*WORK, *TRANSFER)}
        loads.append(
            StageLoad(
                stage=k,
                layers=first.layers,
                parameters=first.parameters,
                forward=mean["forward"],
                recompute=mean["recompute"],
                backward=mean["backward"] + mean["weight"],
                loss=mean["loss"],
                waiting=mean["recv"] + mean["send"] + mean["relay"],
                activation_bytes=max(t.peak_activation_bytes for t in traces),
            )
        )
    return loads


def imbalance(loads: Sequence[StageLoad]) -> float:
    """The slowest stage's work over the mean work of the stages (1.0 is perfectly balanced)."""
    mean = sum(load.work for load in loads) / len(loads)
    return max(load.work for load in loads) / mean if mean > 0 else 1.0


def profile_check(
    costs: Sequence[LayerCost], loads: Sequence[StageLoad], micro_batches: int, checkpoint: str, split: bool
) -> dict[str, list[float]]:
    """The profile's prediction of each stage's busy seconds per step (its forwards, recomputes and backwards:
    :func:`~lightning_gpipe.lightning.resplit.profiled_busy` of the profiled ``costs``, ``split``: whether the run
    splits its backwards into B and W) against the measured ones (``loads``): ``profiled_s``, ``measured_s`` and
    ``profile_error`` (:func:`~lightning_gpipe.lightning.resplit.profile_errors`)."""
    profiled = profiled_busy(costs, [load.layers for load in loads], micro_batches, checkpoint, split)
    measured = [load.forward + load.recompute + load.backward for load in loads]
    return {"profiled_s": profiled, "measured_s": measured, "profile_error": profile_errors(profiled, measured)}


def layer_estimates(loads: Sequence[StageLoad], micro_batches: int) -> list[LayerCost]:
    """Per-layer costs for one micro-batch, spreading each stage's measured time evenly over its layers.

    The recompute is counted as forward time (it is one), so the estimate holds for any checkpoint mode.
    """
    costs = []
    for load in loads:
        forward = (load.forward + load.recompute) / 2 if load.recompute else load.forward
        costs += [
            LayerCost(forward / load.layers / micro_batches, load.backward / load.layers / micro_batches)
        ] * load.layers
    return costs


def suggest_balance(
    costs: Sequence[LayerCost], num_stages: int, checkpoint: str, micro_batches: int, loss: float = 0.0
) -> list[int]:
    """The ``balance`` minimising the slowest stage's time per micro-batch (:func:`lightning_gpipe.solve`).

    Args:
        costs: per-layer costs for one micro-batch.
        num_stages: K.
        checkpoint: the checkpoint mode, which decides how many forwards are recomputed.
        micro_batches: M.
        loss: seconds per step of the head and loss, which always run with the last layer.
    """
    recomputed = recomputed_share(checkpoint, micro_batches)
    times = [c.forward * (1 + recomputed) + c.backward for c in costs]
    times[-1] += loss / micro_batches
    return solve(times, num_stages)


MIN_GAIN = 0.01
"""The least share of the step a split must be predicted to save to be suggested: below it, the costs' noise decides."""


@dataclass(frozen=True)
class Suggestion:
    """The fastest split the simulator found against the current one (see :func:`fastest_split`).

    Args:
        balance: the current ``balance``.
        step: its simulated step time in seconds.
        best: the fastest split found (the current one when none is faster).
        best_step: its simulated step time in seconds.
    """

    balance: list[int]
    step: float
    best: list[int]
    best_step: float

    @property
    def speedup(self) -> float:
        """How many times as fast as the current split the best one is predicted (1.0: no faster)."""
        return self.step / self.best_step if self.best_step > 0 else 1.0

    @property
    def suggested(self) -> list[int] | None:
        """The best split if it is another one predicted at least :data:`MIN_GAIN` faster, else ``None``."""
        return self.best if self.best != self.balance and self.best_step < (1 - MIN_GAIN) * self.step else None


def fastest_split(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    micro_batches: int,
    checkpoint: str,
    loss: float = 0.0,
    schedule: str = "gpipe",
    defer_weight_grad: bool | None = None,
) -> Suggestion:
    """The fastest split by :func:`~lightning_gpipe.planning.simulator.simulate`'s step time, from the solver's split.

    :func:`suggest_balance` evens out the stages' times, which is not the same as the fastest step (a stage's
    recompute can hide in its wait for a gradient, the head runs once between fill and drain): so the search starts
    from its split and moves one boundary by one layer while that shortens the simulated step.

    Args:
        costs: per-layer costs for one micro-batch.
        balance: the current split, simulated alike.
        micro_batches: M.
        checkpoint: the checkpoint mode.
        loss: seconds per step of the head and loss.
        schedule: the schedule, as for ``GPipeStrategy`` (default ``"gpipe"``).
        defer_weight_grad: whether backwards are split into B and W, as for ``GPipeStrategy``.
    """

    def step(split: Sequence[int]) -> float:
        stages = stage_costs(costs, split)
        return simulate(
            stages, micro_batches, checkpoint, loss=loss, schedule=schedule, defer_weight_grad=defer_weight_grad
        ).step_time

    best = suggest_balance(costs, len(balance), checkpoint, micro_batches, loss)
    best_step, improved = step(best), True
    while improved:
        improved = False
        for k, move in product(range(len(best) - 1), (-1, 1)):  # stage k gives one layer to k + 1, or takes one
            split = [*best[:k], best[k] + move, best[k + 1] - move, *best[k + 2 :]]
            if min(split) >= 1 and (candidate := step(split)) < best_step:
                best, best_step, improved = split, candidate, True
    current = step(balance)
    if current <= best_step:
        best, best_step = list(balance), current
    return Suggestion(list(balance), current, best, best_step)


class PipelineBalance(PipelineCallback):
    """Per stage: parameters, forward, backward and recompute time, waiting, activation memory; the imbalance.

    Measures training steps ``warmup`` to ``warmup + steps - 1`` (batches counted from 0 across epochs), then,
    on global rank 0: prints a table (so it appears after the first measured steps, not before the first
    step), logs ``pipeline/imbalance`` and ``pipeline/stage{k}/{forward,recompute,backward,loss,waiting}_s``
    and ``.../activation_bytes`` to the trainer's loggers, and writes ``pipeline_balance.json`` into the
    logger's ``log_dir`` (or ``default_root_dir``).

    When the imbalance (the slowest stage's work over the mean) exceeds ``threshold``, it looks for a faster
    ``balance`` (:func:`fastest_split`: :func:`lightning_gpipe.solve`'s split, improved one boundary at a time on the
    step time :func:`lightning_gpipe.planning.simulator.simulate` predicts for the run's schedule), on the strategy's
    profiled per-layer costs (``strategy.layer_costs``, a list of
    :class:`~lightning_gpipe.planning.balance.costs.LayerCost`) when it has them, else on the measured stage times
    spread evenly over each stage's layers. It suggests that split only when the simulator predicts it at least
    :data:`MIN_GAIN` faster than the current one, and says by how much; otherwise it says that no faster split was
    found. With ``virtual_stages > 1`` it reports the stages (``balance``: the layers each stage holds over all its
    model chunks) and suggests nothing.

    Where the strategy profiled its layers (``strategy.layer_costs``, one model chunk per stage), the report holds the
    profile's prediction of each stage's busy time per step against the measured one (:func:`profile_check`:
    ``profiled_s``, ``measured_s``, ``profile_error``), the table says it in one line, and
    ``pipeline/stage{k}/profile_error`` is logged.

    Where the strategy re-split the pipeline from its measured stage times (``balance="time"``, see
    :mod:`~lightning_gpipe.lightning.resplit`), or checked the split and kept it, the report's ``"resplit"`` says
    what it found, at the end of training.

    Activation memory is counted in the measured steps only (a hook per saved tensor, a few percent of
    those steps' time).

    Args:
        warmup: steps not measured at the start (default 1: the first step sets up connections).
        steps: steps measured (default 3).
        threshold: imbalance above which a balance is suggested (default 1.1).

    Raises:
        ValueError: for ``warmup < 0``, ``steps < 1`` or ``threshold < 1``.
    """

    counts_memory = True

    def __init__(self, warmup: int = 1, steps: int = 3, threshold: float = 1.1) -> None:
        if warmup < 0 or steps < 1 or threshold < 1:
            raise ValueError(f"PipelineBalance(warmup={warmup}, steps={steps}, threshold={threshold}) is invalid.")
        self.warmup, self.steps, self.threshold = warmup, steps, threshold
        self.measured: list[StepTrace] = []
        self.report: dict | None = None

    @override
    def wants(self, batch: int) -> bool:
        """The measured steps."""
        return self.warmup <= batch < self.warmup + self.steps

    @override
    def on_step(self, trainer: "pl.Trainer", step: StepTrace) -> None:
        """Keep the step; after the last measured one, report."""
        self.measured.append(step)
        if len(self.measured) == self.steps:
            self.report = self._report(trainer)
            self._write(trainer)
            rank_zero_info(format_table(self.report))

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Add what the strategy's check of the split found (``strategy.resplit.record``, see
        :mod:`~lightning_gpipe.lightning.resplit`) to the report, as ``"resplit"``, and write it again."""
        check = getattr(trainer.strategy, "resplit", None)
        if self.report is None or check is None or check.record is None:
            return
        self.report["resplit"] = check.record
        self._write(trainer)

    def _write(self, trainer: "pl.Trainer") -> None:
        with open(os.path.join(log_dir(trainer), "pipeline_balance.json"), "w") as f:
            json.dump(self.report, f, indent=1)

    def _report(self, trainer: "pl.Trainer") -> dict:
        assert isinstance(trainer.strategy, GPipeStrategy)  # steps are gathered under it only
        loads = stage_loads(self.measured)
        micro_batches, checkpoint = self.measured[0].micro_batches, trainer.strategy.config.checkpoint
        virtual_stages = trainer.strategy.config.virtual_stages
        assert checkpoint is not None and virtual_stages is not None  # PipelineConfig gave the defaults
        report: dict[str, Any] = {
            "steps": [s.step for s in self.measured],
            "chunks": micro_batches,  # the strategy option's name, as in the JSON file users read
            "checkpoint": checkpoint,
            "balance": [load.layers for load in loads],
            "stages": [asdict(load) for load in loads],
            "imbalance": imbalance(loads),
            "suggested_balance": None,
        }
        profiled, config = getattr(trainer.strategy, "layer_costs", None), trainer.strategy.config
        if profiled and virtual_stages == 1:
            report |= profile_check(profiled, loads, micro_batches, checkpoint, config.splits_backward)
        metrics = {"pipeline/imbalance": report["imbalance"]}
        for load in loads:
            for name in ("forward", "recompute", "backward", "loss", "waiting"):
                metrics[f"pipeline/stage{load.stage}/{name}_s"] = getattr(load, name)
            metrics[f"pipeline/stage{load.stage}/activation_bytes"] = load.activation_bytes
        for k, error in enumerate(report.get("profile_error", ())):
            metrics[f"pipeline/stage{k}/profile_error"] = error
        log_metrics(trainer, metrics)
        if report["imbalance"] <= self.threshold or virtual_stages > 1:
            return report  # with virtual stages a stage's layers are not contiguous: no split is suggested
        costs = list(profiled) if profiled else layer_estimates(loads, micro_batches)
        assert config.schedule is not None  # PipelineConfig gave the default
        found = fastest_split(
            costs, report["balance"], micro_batches, checkpoint, loads[-1].loss, config.schedule, config.splits_backward
        )
        report["suggested_balance"] = found.suggested
        report["cost_source"] = "profiled layer costs" if profiled else "measured stage times"
        report |= {"predicted_step_s": found.step, "best_balance": found.best, "best_step_s": found.best_step}
        report["speedup"] = found.speedup
        return report


def format_table(report: dict) -> str:
    """The readable table of a :class:`PipelineBalance` report."""
    steps = report["steps"]
    lines = [
        f"Pipeline balance, mean per step over training steps {steps[0]}-{steps[-1]}"
        f" (M={report['chunks']}, checkpoint={report['checkpoint']!r}):",
        f"{'stage':>5} {'layers':>6} {'params':>9} {'forward':>9} {'recompute':>9} {'backward':>9} {'loss':>9}"
        f" {'waiting':>9} {'act. mem':>9}",
    ]
    for s in report["stages"]:
        times = " ".join(f"{1e3 * s[k]:7.1f}ms" for k in ("forward", "recompute", "backward", "loss", "waiting"))
        lines.append(
            f"{s['stage']:>5} {s['layers']:>6} {s['parameters'] / 1e6:8.2f}M {times}"
            f" {s['activation_bytes'] / 2**20:6.1f}MiB"
        )
    if "profiled_s" in report:
        lines.append(f"busy per step: {profile_line(report['profiled_s'], report['measured_s'])}")
    lines.append(f"imbalance (slowest stage's work over the mean): {report['imbalance']:.2f}")
    if report["suggested_balance"] is not None:
        lines.append(
            f"suggested balance={report['suggested_balance']} instead of {report['balance']}"
            f" (from {report['cost_source']}): simulated step {report['best_step_s']:.4g}s vs"
            f" {report['predicted_step_s']:.4g}s, {report['speedup']:.2f}x as fast"
        )
    elif "best_balance" in report:
        lines.append(
            f"no faster balance than {report['balance']} found (from {report['cost_source']}; simulated step"
            f" {report['predicted_step_s']:.4g}s; no other split is predicted {MIN_GAIN:.0%} faster or more)"
        )
    return "\n".join(lines)
