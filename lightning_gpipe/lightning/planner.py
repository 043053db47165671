"""Planning a pipeline for a module: without training (:func:`plan`), or in ``GPipeStrategy(plan="auto")``'s setup
(:func:`plan_for_strategy`)."""

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn

from lightning_gpipe.lightning.backbone import find_backbone, profile_module
from lightning_gpipe.lightning.config import check_tensor_parallel_scaler
from lightning_gpipe.lightning.tensor_parallel import layer_splits
from lightning_gpipe.planning import (
    Constraints,
    CostModel,
    PlanReport,
    ProfiledCosts,
    module_state_factor,
    optimizer_state_factor,
    per_tensor_rank,
    search,
)

ASSUMED_STATE_FACTOR = 2
"""Optimizer state tensors per parameter assumed when ``configure_optimizers`` cannot be read (Adam's)."""


def plan(
    module: LightningModule,
    world_size: int,
    memory_limit: int,
    example_batch: Any = None,
    optimizer: None | str | torch.optim.Optimizer = None,
    device: torch.device | str = "cpu",
    backbone: str | None = None,
    cost_model: CostModel = CostModel(),
    pipeline_parallel_size: int | None = None,
    data_parallel_size: int | None = None,
    chunks: int | None = None,
    checkpoint: str | None = None,
    schedule: str | None = None,
    balance: None | str | Sequence[int] = None,
    virtual_stages: int | None = None,
    sharding_strategy: str | None = None,
    offload: str | bool | None = None,
    tensor_parallel_size: int = 1,
    tensor_plan: dict[str, Any] | None = None,
) -> PlanReport:
    """Plan a pipeline for ``module`` on ``world_size`` devices of ``memory_limit`` bytes each, without training.

    ``GPipeStrategy(plan="auto")``'s planner (docs/planning.md) over every mesh, by predicted seconds per trained row;
    for several ``world_size``, "how many devices does this model need"; returns a :class:`~lightning_gpipe.PlanReport`.

    Args:
        module: the LightningModule. If its backbone does not exist yet (built in ``configure_model``), that hook
            is called under ``torch.device("meta")``: each layer is initialised only while it is profiled.
        world_size: devices (processes) of the job.
        memory_limit: bytes each device may hold (parameters, gradients, optimizer state, activations, buffers).
        example_batch: one training batch as the loader yields it (per replica), on which the backbone input and the
            rest of the step (head, loss) are measured; ``None``: the module's ``example_input_array`` (no loss).
        optimizer: for its state's size, an optimizer or a name (``"sgd"``, ``"adamw"``...); None: the module's own.
        device: where to profile the layers (default ``"cpu"``); use the kind of device you will train on.
        backbone: the ``nn.Sequential`` attribute; ``None`` finds the only one.
        cost_model: the machine's constants (see docs/planning.md, "Calibrating").
        pipeline_parallel_size: K, fixed; ``None`` (default): the planner's choice, as for the options below.
        data_parallel_size: D, fixed.
        chunks: M, fixed.
        checkpoint: the re-materialization mode, fixed.
        schedule: the schedule, fixed.
        balance: layers per (virtual) stage (a list), or a mode of :data:`lightning_gpipe.planning.balance.MODES`.
        virtual_stages: model chunks per stage, fixed (planned, 1 or 2, only on the CPU, where they have run).
        sharding_strategy: fixed; planned: ``"NO_SHARD"`` or ``"SHARD_GRAD_OP"`` (FSDP2) where D > 1.
        offload: ``"activations"``, or ``False`` for none, fixed; planned only on an accelerator ``device``.
        tensor_parallel_size: T, fixed (default 1): each process predicted as one tensor rank of its stage holds it.
        tensor_plan: with T > 1, the plan ``configure_model`` gives ``parallelize_module`` (None: the declared one).

    Raises:
        ValueError: for no backbone input (``example_batch`` or ``example_input_array``), constraints that leave no
            plan, a limit no plan fits (naming the smallest limit that would fit), or with T > 1 no known split.
    """
    name = _built_backbone(module, backbone, example_batch)
    fixed = (pipeline_parallel_size, data_parallel_size, chunks, checkpoint, schedule, balance, virtual_stages)
    device = torch.device(device)
    constraints = _interleaving(Constraints(*fixed, sharding_strategy, offload, tensor_parallel_size), device)
    profiled = _tensor_rank_profile(module, name, device, example_batch, constraints, tensor_plan, cost_model)
    factor = optimizer_state_factor(optimizer) if optimizer is not None else _state_factor(module)
    return search(world_size, profiled, memory_limit, factor, cost_model, constraints, device.type)


def _tensor_rank_profile(
    module: LightningModule,
    name: str,
    device: torch.device | str,
    example_batch: Any,
    constraints: Constraints,
    tensor_plan: dict[str, Any] | None,
    cost_model: CostModel,
) -> ProfiledCosts:
    """:func:`~lightning_gpipe.lightning.backbone.profile_module`'s costs of the backbone ``name`` as one tensor rank
    of its stage has them (:func:`~lightning_gpipe.planning.per_tensor_rank`; the split, from ``tensor_plan`` or the
    module, refused before the profile if unknown: :func:`~lightning_gpipe.lightning.tensor_parallel.layer_splits`)."""
    size = constraints.tensor_parallel_size
    splits = layer_splits(module, name, size, tensor_plan)
    profiled = profile_module(module, name, device, example_batch, constraints.micro_batches, constraints.splits)
    return per_tensor_rank(profiled, splits, size, cost_model)


def _interleaving(constraints: Constraints, device: torch.device) -> Constraints:
    """``constraints`` with one model chunk per stage fixed where the planner does not interleave on its own: on
    CUDA, where interleaving (one NCCL communicator per virtual link, :mod:`lightning_gpipe.engine.channels`) has not
    been
    run. A fixed ``virtual_stages`` is kept (given by the user, who asked for it)."""
    if constraints.virtual_stages is not None or device.type == "cpu":
        return constraints
    return replace(constraints, virtual_stages=1)


def _built_backbone(module: LightningModule, backbone: str | None, example_batch: Any) -> str:
    """The backbone's name, building it on the meta device with ``configure_model`` if it does not exist yet.

    Raises:
        ValueError: without a sample of its input (``example_batch`` or the module's ``example_input_array``).
    """
    if example_batch is None and module.example_input_array is None:
        raise ValueError(
            "lightning_gpipe.plan needs a sample of the backbone input: pass example_batch=<one training batch> or"
            " set the module's example_input_array."
        )
    try:
        return find_backbone(module, backbone)
    except ValueError:
        with torch.device("meta"):
            module.configure_model()
        return find_backbone(module, backbone)


def _state_factor(module: LightningModule) -> int:
    factor = module_state_factor(module)
    if factor is None:
        rank_zero_warn(
            "The planner could not read the optimizer from `configure_optimizers()`; it assumes Adam's state (two"
            " tensors per parameter). Pass the optimizer to `lightning_gpipe.plan(optimizer=...)` to be exact."
        )
        return ASSUMED_STATE_FACTOR
    return factor


def plan_for_strategy(
    module: LightningModule,
    backbone: str,
    config: Any,
    mesh: tuple[int, int],
    device: torch.device,
    profile: Callable[[], ProfiledCosts | None],
    share: Callable[[Any], Any],
    whole: bool = False,
) -> PlanReport:
    """The plan of ``GPipeStrategy(plan="auto")`` at setup, on every process alike.

    Args:
        module: the LightningModule, attached to its Trainer, before the split.
        backbone: the attribute of its backbone.
        config: the strategy's :class:`~lightning_gpipe.lightning.config.PipelineConfig` (its constraints, limit and
            model).
        mesh: ``(K, D)``, the mesh the job was launched with: the process groups exist before the model does (see
            docs/planning.md), so the planner keeps it; its stages have ``config.tensor_parallel_size`` tensor ranks,
            each predicted as one of them holds and runs the stage (from the module's declared split,
            :func:`~lightning_gpipe.lightning.tensor_parallel.layer_splits`).
        device: this process's device (for the default memory limit on CUDA).
        profile: measures the backbone on global rank 0 (``None`` elsewhere).
        share: sends a picklable object from global rank 0 to every process (a collective call).
        whole: keep each stage's state whole (``"NO_SHARD"``) where the user left ``sharding_strategy`` to the
            planner: the run's precision has a gradient scaler, which sharded gradients do not take (default
            ``False``).

    Raises:
        ValueError: on the CPU without ``memory_limit``, for constraints that leave no plan, or a limit no plan fits
            (naming the smallest limit that would fit); with tensor parallelism, for a module that declares no split
            or with ``whole`` (:func:`~lightning_gpipe.lightning.config.check_tensor_parallel_scaler`); on every
            process, before the first step.
    """
    check_tensor_parallel_scaler(config, whole)  # no sharding takes a scaler's tensor-parallel gradients
    limit = config.memory_limit if config.memory_limit is not None else _device_memory(device)
    tensor = config.tensor_parallel_size
    splits = layer_splits(module, backbone, tensor)
    profiled, factor = share((profile(), module_state_factor(module)))
    if factor is None:
        factor = _state_factor(module)
    constraints = replace(config.constraints(), pipeline_parallel_size=mesh[0], data_parallel_size=mesh[1])
    if whole and constraints.sharding_strategy is None:
        constraints = replace(constraints, sharding_strategy="NO_SHARD")
    constraints = _interleaving(constraints, device)
    model = config.cost_model or CostModel()
    profiled = per_tensor_rank(profiled, splits, tensor, model)
    return search(mesh[0] * mesh[1] * tensor, profiled, share(limit), factor, model, constraints, device.type)


def _device_memory(device: torch.device) -> int:
    """The free memory CUDA reports on ``device``.

    Raises:
        ValueError: on any other device (a CPU has no memory of its own to report).
    """
    if device.type != "cuda":
        raise ValueError(
            f"GPipeStrategy(plan='auto') on {device.type!r} needs memory_limit=BYTES, the memory one process may"
            " hold: the planner cannot read a device's memory there."
        )
    return torch.cuda.mem_get_info(device)[0]
