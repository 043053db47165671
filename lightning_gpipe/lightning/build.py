"""Building this process's stage at setup, a pipeline of values.

:func:`build_stage` chooses the balance (the planner's solver where a mode or a limit chooses it), models the
actions' costs where the schedule places them by cost, turns the strategy's options into the engine's
:class:`~lightning_gpipe.engine.StageSpec`, builds the :class:`~lightning_gpipe.engine.StagePipeline` through the
engine's one door (:func:`~lightning_gpipe.engine.build_pipeline`), and installs the user contract's
:class:`~lightning_gpipe.lightning.contract.BackboneCall` in front of it. The strategy then holds the
:class:`~lightning_gpipe.lightning.step.StageRun` it returns.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gpipe.engine import StageSpec, Topology, build_pipeline
from lightning_gpipe.faults import Job
from lightning_gpipe.lightning.config import PipelineConfig, offload_note
from lightning_gpipe.lightning.contract import BackboneCall, StageRandomness
from lightning_gpipe.lightning.current_values import kept_values
from lightning_gpipe.lightning.relay import LogRelay, StepRelay
from lightning_gpipe.lightning.step import StageRun
from lightning_gpipe.planning import (
    CostModel,
    LayerCost,
    action_costs,
    modelled_stage_costs,
    module_state_factor,
    resolve_balance,
    state_copies,
)


class Process(NamedTuple):
    """Where this process sits in the job.

    Attributes:
        topology: the mesh; ``rank`` is this process's global rank in it.
        rank: this process's global rank.
        device: the stage's device.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (the links' waits, the ties' collectives).
        control: the CPU (gloo) process group of the links' control messages on a job whose links are not gloo
            (NCCL); ``None``: the links' own groups.
    """

    topology: Topology
    rank: int
    device: torch.device
    job: Job
    control: dist.ProcessGroup | None = None


def stage_spec(
    module: "pl.LightningModule", name: str, config: PipelineConfig, process: Process, costs: list[LayerCost] | None
) -> StageSpec:
    """The engine's spec of this process's stage: the strategy's options with the balance chosen (``costs``: the
    backbone layers' profiled costs, where the balance or the schedule needs them) and, for a schedule placed by
    cost, the actions' costs modelled by the planner (the engine never calls it).

    Raises:
        ValueError: if ``balance`` does not fit the backbone.
    """
    topology = process.topology
    if note := offload_note(config, process.device.type):  # once per run: stage_spec runs once per setup
        rank_zero_info(note)
    balance = stage_balance(module, name, config, topology, costs)
    assert config.schedule is not None and config.checkpoint is not None  # PipelineConfig gave the defaults
    placed = None
    if config.placed_by_cost:
        assert costs is not None  # the strategy profiles the layers for a schedule placed by cost
        placed = action_costs(modelled_stage_costs(costs, balance, config.cost_model or CostModel(), split=True))
    return StageSpec(
        topology,
        process.rank,
        process.device,
        balance=tuple(balance),
        schedule=config.schedule,
        micro_batches=config.micro_batches_for(topology.num_stages),
        checkpoint=config.checkpoint,
        defer_weight_grad=config.splits_backward,
        compile=config.compile,
        deferred_batch_norm=config.deferred_batch_norm,
        action_costs=placed,
        control=process.control,
        offload=config.offload,
    )


def stage_balance(
    module: "pl.LightningModule", name: str, config: PipelineConfig, topology: Topology, costs: list[LayerCost] | None
) -> list[int]:
    """Backbone layers per (virtual) stage: the user's ``balance``, or the one its mode chooses (from ``costs`` only
    where the mode or a limit needs them: otherwise ``"params"`` counts the parameters, whether profiled or not).
    Under FSDP2 with several replicas, ``"memory"`` counts each layer's state as a process holds it
    (:func:`sharded_state_copies`).

    Raises:
        ValueError: if ``balance`` does not fit the backbone, or no split fits ``balance_memory_limit``.
    """
    limit, v = config.balance_memory_limit, topology.virtual_stages
    measured = costs if config.profiled else None
    copies = sharded_state_copies(module, config, topology.data_parallel_size)
    try:
        layers, stages = getattr(module, name), topology.num_virtual
        return resolve_balance(config.balance, layers, stages, measured, limit, v, copies)
    except ValueError as error:
        if limit is None:
            raise
        raise ValueError(f"GPipeStrategy(balance={config.balance!r}, balance_memory_limit={limit}): {error}") from error


def sharded_state_copies(module: "pl.LightningModule", config: PipelineConfig, replicas: int) -> float:
    """The bytes ``balance="memory"`` counts per byte of a layer's parameters (1 under any other balance): 1 (the
    parameters) for whole state;
    sharded by FSDP2 over several ``replicas``, the state a process holds (:func:`~lightning_gpipe.planning.
    state_copies`: ``1/D`` of parameters, gradients and optimizer state, and the gathered parameters and unsharded
    gradients of the backward), with the optimizer's state read from ``configure_optimizers()`` (Adam's if it cannot
    be read)."""
    if config.balance != "memory" or config.sharding_strategy == "NO_SHARD" or replicas < 2:
        return 1.0
    factor = module_state_factor(module)
    return state_copies(2 if factor is None else factor, replicas, sharded=True)


def build_stage(
    module: "pl.LightningModule",
    name: str,
    spec: StageSpec,
    job: Job,
    randomness: StageRandomness,
    share: Callable[[Any], Any],
    relays: tuple[LogRelay, StepRelay],
) -> StageRun:
    """Split ``module`` into this process's stage and return its :class:`~lightning_gpipe.lightning.step.StageRun`
    (then call its :meth:`~lightning_gpipe.lightning.step.StageRun.start`). A collective call.

    Args:
        module: the LightningModule, whole (or created on the meta device).
        name: the attribute of its ``nn.Sequential`` backbone.
        spec: the stage's spec (:func:`stage_spec`).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`.
        randomness: the stage's random streams (see :class:`~lightning_gpipe.lightning.contract.StageRandomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        relays: the logging relays of this process's pipeline: after evaluation steps and epoch-end hooks, and
            in training steps.

    Raises:
        ValueError: if the skip connections do not pair up.
    """
    kept = kept_values(module)  # before the split frees what this stage does not hold
    pipeline = build_pipeline(module, name, spec, job)
    call = BackboneCall(pipeline, pipeline.is_last, share=share, randomness=randomness, position=job.position)
    pipeline.partition.backbone_call = call
    relay, step_relay = relays
    return StageRun(pipeline, call, relay, step_relay, randomness, share, job, kept=kept)
