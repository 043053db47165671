"""The backbone measured before the split: once per run, on global rank 0, shared with every process.

``GPipeStrategy`` measures the whole backbone in ``setup``, before each process keeps only its stage: the
per-layer costs a profiled ``balance`` mode or the default's choice of the B/W split needs
(:func:`shared_layer_costs`, kept in ``strategy.layer_costs``; the choice: :func:`chosen_split`, kept in
``strategy.config``) and the plan of ``plan="auto"`` (:func:`planned_config`, kept in ``strategy.plan_report``). All
run on global rank 0 only and are broadcast, so every stage splits alike; all are kept on the strategy and reused by
its later runs (``fit`` then ``validate``) while the backbone keeps its number of layers.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_gpipe.engine import Topology
from lightning_gpipe.lightning.backbone import profile_backbone, profile_module
from lightning_gpipe.lightning.build import stage_balance
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.planner import plan_for_strategy
from lightning_gpipe.lightning.step import step_casts_cached
from lightning_gpipe.planning import LayerCost, SplitChoice, choose_split

Strategy = Any
"""The ``GPipeStrategy`` being set up (not imported: the strategy imports this module)."""


@contextmanager
def _measuring(strategy: Strategy, what: str) -> Iterator[None]:
    """Under the precision plugin's step context with the weights' casts cached as a pipeline step caches them
    (:func:`~lightning_gpipe.lightning.step.step_casts_cached`), in a phase the watchdog does not count as a stall."""
    with strategy.precision_plugin.train_step_context(), step_casts_cached():
        with strategy.job.position.unbounded_phase(what):
            yield


def shared_layer_costs(
    strategy: Strategy, module: "pl.LightningModule", name: str, choosing: bool = False
) -> list[LayerCost] | None:
    """The backbone layers' costs where the balance or the schedule needs them (``strategy.config.profiled``) or
    (``choosing``) the default chooses the B/W split, else ``None``: profiled on global rank 0
    (:func:`~lightning_gpipe.lightning.backbone.profile_backbone`) as the pipeline runs them: on one of the run's
    micro-batches, under the precision plugin's step context (:func:`_measuring`), with the B/W split where the run
    splits its backwards, a schedule is placed by cost or the default chooses; broadcast, and kept in
    ``strategy.layer_costs``. Where only the choice needs them, a backbone that cannot be profiled gives ``None`` (the
    choice keeps whole backwards) instead of stopping the run."""
    config = strategy.config
    if not (config.profiled or choosing):
        return None
    costs, split = strategy.layer_costs, config.placed_by_cost or choosing or config.splits_backward
    unsplit = split and costs is not None and not any(cost.weight_grad for cost in costs)
    if costs is None or len(costs) != len(getattr(module, name)) or unsplit:
        micro_batches = config.micro_batches_for(strategy.topology.num_stages)
        with _measuring(strategy, "profiling the backbone"):
            own = _profiled(module, name, micro_batches, strategy.root_device, split, config.profiled)
        strategy.layer_costs = strategy.broadcast(own if strategy.is_global_zero else None, src=0)
    return strategy.layer_costs


def _profiled(
    module: "pl.LightningModule", name: str, micro_batches: int, device: Any, split: bool, needed: bool
) -> list[LayerCost] | None:
    """:func:`~lightning_gpipe.lightning.backbone.profile_backbone`, or ``None`` where it fails and the costs are
    not ``needed`` (only the default's choice of the split asked for them)."""
    try:
        return profile_backbone(module, name, micro_batches, device, split)
    except Exception as error:  # noqa: BLE001 - a run the choice cannot profile trains as before, with whole backwards
        if needed:
            raise
        rank_zero_warn(f"GPipeStrategy could not profile the backbone, so it keeps whole backwards: {error}")
        return None


def chosen_split(
    strategy: Strategy, module: "pl.LightningModule", name: str, costs: list[LayerCost] | None
) -> PipelineConfig:
    """``strategy.config`` with ``defer_weight_grad`` chosen by :func:`~lightning_gpipe.planning.split.choose_split`
    from the profiled ``costs`` (whole backwards without them): decided on global rank 0, broadcast so that every
    process runs the same plan, and printed there in one line."""
    config, topology = strategy.config, strategy.topology
    balance = stage_balance(module, name, config, topology, costs)  # on every process: a bad balance fails on each
    own = _split_choice(config, topology, balance, costs) if strategy.is_global_zero else None
    choice = strategy.broadcast(own, src=0)
    rank_zero_info(split_line(choice))
    return replace(config, defer_weight_grad=choice.split)


def split_line(choice: SplitChoice) -> str:
    """One line for the log: the option the default chose, the predicted step times and the reason."""
    chosen = "defer_weight_grad=True (the B/W split)" if choice.split else "whole backwards (defer_weight_grad=False)"
    return (
        f"GPipeStrategy chose {chosen}: {choice.reason}. Pass defer_weight_grad=True or False (or a schedule) to fix"
        " the choice."
    )


def _split_choice(
    config: PipelineConfig, topology: Topology, balance: list[int], costs: list[LayerCost] | None
) -> SplitChoice:
    """:func:`~lightning_gpipe.planning.split.choose_split` on the ``balance`` this run will split by."""
    if costs is None:
        return SplitChoice(False, 0.0, 0.0, "the backbone could not be profiled (see the warning above)")
    assert config.checkpoint is not None  # PipelineConfig gave the default
    micro_batches, limit = config.micro_batches_for(topology.num_stages), config.balance_memory_limit
    return choose_split(costs, balance, micro_batches, config.checkpoint, topology.virtual_stages, memory_limit=limit)


def planned_config(
    strategy: Strategy, requested: PipelineConfig, module: "pl.LightningModule", name: str
) -> PipelineConfig:
    """``requested`` with ``chunks``, checkpoint mode, schedule, virtual stages, balance, sharding and offload of
    ``plan="auto"``'s plan (:func:`~lightning_gpipe.lightning.planner.plan_for_strategy`, profiled on global rank 0,
    with each backward split into B and W where the planner considers the schedules that split them), kept with its
    report in ``strategy.plan_report`` and printed on global rank 0. A precision with a gradient scaler
    (``"16-mixed"``), which sharded gradients do not take, keeps the stages' state whole.

    Raises:
        ValueError: on every process, on the CPU without ``memory_limit``, or if no plan fits the limit or the
            options given.
    """
    report = strategy.plan_report
    if report is None or sum(report.chosen.plan.balance) != len(getattr(module, name)):
        device, zero = strategy.root_device, strategy.is_global_zero

        def profile():
            split = requested.constraints().splits
            return profile_module(module, name, device, micro_batches=requested.chunks, split=split) if zero else None

        mesh = (strategy.topology.num_stages, strategy.topology.data_parallel_size)
        whole = getattr(strategy.precision_plugin, "scaler", None) is not None
        with _measuring(strategy, "planning"):
            report = plan_for_strategy(module, name, requested, mesh, device, profile, strategy.broadcast, whole)
        strategy.plan_report = report
        rank_zero_info(report.table())
    chosen = report.chosen.plan
    keys = ("checkpoint", "schedule", "virtual_stages", "sharding_strategy", "offload")
    options = {key: getattr(chosen, key) for key in keys}
    return replace(requested, chunks=chosen.micro_batches, balance=list(chosen.balance), **options)
