"""The backbone measured before the split: once per run, on global rank 0, shared with every process.

``GPipeStrategy`` measures the whole backbone in ``setup``, before each process keeps only its stage: the
per-layer costs a profiled ``balance`` mode needs (:func:`shared_layer_costs`, kept in ``strategy.layer_costs``)
and the plan of ``plan="auto"`` (:func:`planned_config`, kept in ``strategy.plan_report``). Both run on global rank
0 only and are broadcast, so every stage splits alike; both are kept on the strategy and reused by its later runs
(``fit`` then ``validate``) while the backbone keeps its number of layers.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gpipe.lightning.backbone import profile_backbone, profile_module
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.planner import plan_for_strategy
from lightning_gpipe.planning.balance.costs import LayerCost

Strategy = Any
"""The ``GPipeStrategy`` being set up (not imported: the strategy imports this module)."""


@contextmanager
def _measuring(strategy: Strategy, what: str) -> Iterator[None]:
    """Under the precision plugin's step context, in a phase the watchdog does not count as a stall."""
    with strategy.precision_plugin.train_step_context(), strategy.job.position.unbounded_phase(what):
        yield


def shared_layer_costs(strategy: Strategy, module: "pl.LightningModule", name: str) -> list[LayerCost] | None:
    """The backbone layers' costs where the balance or the schedule needs them (``strategy.config.profiled``), else
    ``None``: profiled on global rank 0 (:func:`~lightning_gpipe.lightning.backbone.profile_backbone`, with the B/W
    split for a schedule placed by cost), broadcast, and kept in ``strategy.layer_costs``."""
    if not strategy.config.profiled:
        return None
    costs, split = strategy.layer_costs, strategy.config.placed_by_cost
    unsplit = split and costs is not None and not any(cost.weight_grad for cost in costs)
    if costs is None or len(costs) != len(getattr(module, name)) or unsplit:
        chunks = strategy.config.micro_batches_for(strategy.topology.num_stages)
        with _measuring(strategy, "profiling the backbone"):
            zero = strategy.is_global_zero
            own = profile_backbone(module, name, chunks, strategy.root_device, split) if zero else None
        strategy.layer_costs = strategy.broadcast(own, src=0)
    return strategy.layer_costs


def planned_config(
    strategy: Strategy, requested: PipelineConfig, module: "pl.LightningModule", name: str
) -> PipelineConfig:
    """``requested`` with the chunks, checkpoint mode, schedule, virtual stages and balance of ``plan="auto"``'s
    plan (:func:`~lightning_gpipe.lightning.planner.plan_for_strategy`, profiled on global rank 0), kept with its report
    in ``strategy.plan_report`` and printed on global rank 0.

    Raises:
        ValueError: on every process, on the CPU without ``memory_limit``, or if no plan fits the limit or the
            options given.
    """
    report = strategy.plan_report
    if report is None or sum(report.chosen.plan.balance) != len(getattr(module, name)):
        device, zero = strategy.root_device, strategy.is_global_zero

        def profile():
            split = requested.constraints().splits
            return profile_module(module, name, device, chunks=requested.chunks, split=split) if zero else None

        mesh = (strategy.topology.num_stages, strategy.topology.data_parallel_size)
        with _measuring(strategy, "planning"):
            report = plan_for_strategy(module, name, requested, mesh, device, profile, strategy.broadcast)
        strategy.plan_report = report
        rank_zero_info(report.table())
    chosen = report.chosen.plan
    options = {key: getattr(chosen, key) for key in ("chunks", "checkpoint", "schedule", "virtual_stages")}
    return replace(requested, balance=list(chosen.balance), **options)
