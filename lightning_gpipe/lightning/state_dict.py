"""State dicts of a pipelined module for checkpoints: every stage's weights and optimizer state, original names.

Stages hold disjoint parts of the model under their original parameter names, so the
whole model's state is the union of the stages'. Optimizer state is keyed the same
way, in torch.distributed.checkpoint's flattened form (``state.<parameter>.<key>`` and
``param_groups.<parameter>.<key>``). A checkpoint therefore does not depend on the
number of stages or the ``balance`` it was written with: each stage loads the entries
of its own parameters, whatever the split.

Two layouts, chosen with ``GPipeStrategy(state_dict_type=...)`` as for Lightning's FSDP:

- ``"full"``: one file, gathered on global rank 0 and written by the strategy's
  CheckpointIO. Lightning's ``TorchCheckpointIO`` writes to a temporary file and renames
  it, so a crash while saving leaves the previous file intact.
- ``"sharded"``: a directory written by :mod:`torch.distributed.checkpoint`, each stage
  writing its own tensors, plus ``meta.pt`` with the trainer state (loops, callbacks,
  schedulers). It is written under a temporary name and renamed once complete.
"""

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from lightning_gpipe.faults import collectives
from lightning_gpipe.lightning._lightning import torch_optimizer

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job

METADATA = "meta.pt"
"""File of a sharded checkpoint directory holding everything but the model and optimizer state."""

SHARDED = ("state_dict", "optimizer_states")
"""Entries of a Lightning checkpoint that each stage holds its own part of."""

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This stage's optimizer state, keyed by parameter name (flattened, as torch.distributed.checkpoint does).

    Args:
        module: the stage's LightningModule (its parameters under their original names).
        optimizer: an optimizer over (some of) ``module``'s parameters; one over none (a stage with nothing to
            train, e.g. only frozen layers under LoRA) has an empty state.
    """
    if not _has_parameters(optimizer):
        return {}
    return get_optimizer_state_dict(module, optimizer, options=_FLAT)


def _has_parameters(optimizer: torch.optim.Optimizer) -> bool:
    return any(group["params"] for group in optimizer.param_groups)


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load the entries of ``optimizer``'s parameters from a name-keyed ``state`` of the whole model.

    Raises:
        KeyError: if ``state`` lacks an entry of one of this stage's parameters.
    """
    if _has_parameters(optimizer):
        set_optimizer_state_dict(module, optimizer, state, options=_FLAT)


def load_optimizer_states(module: nn.Module, optimizers: list, states: list[dict[str, Any]]) -> None:
    """Load this stage's entries of every optimizer's name-keyed state (see :func:`load_optimizer_state`).

    Raises:
        ValueError: for a state keyed by index (written without GPipeStrategy): it cannot be split between stages.
    """
    for optimizer, state in zip(optimizers, states):
        if "param_groups" in state:
            raise ValueError(
                "This checkpoint's optimizer state was written without GPipeStrategy (keyed by parameter"
                " index, not name), so it cannot be split between stages. Resume it with the strategy it was"
                " written with, or load only the weights: `Module.load_from_checkpoint(path)`."
            )
        load_optimizer_state(module, torch_optimizer(optimizer), state)


def local_entries(state_dict: dict[str, Tensor], module: nn.Module) -> dict[str, Tensor]:
    """The entries of the whole model's ``state_dict`` that belong to this stage's ``module``.

    Entries of other stages are dropped; missing local entries are left for
    ``load_state_dict(strict=True)`` to report.
    """
    local = module.state_dict().keys()
    return {key: value for key, value in state_dict.items() if key in local}


def gather_union(local: dict[str, Any], group: dist.ProcessGroup | None, job: "Job") -> dict[str, Any] | None:
    """The union of the ``local`` dicts of every process of ``group`` (``None``: all) on global rank 0, ``None``
    elsewhere (a collective call of ``group``, which must hold global rank 0; ``job``: the run's
    :class:`~lightning_gpipe.faults.job.Job`, whose waits the gather uses).

    Tensors are moved to the CPU first, so the result is device-independent.

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    local = {key: value.cpu() if isinstance(value, Tensor) else value for key, value in local.items()}
    if not dist.is_initialized():
        return local
    parts = collectives.gather_object(job, local, dst=0, group=group)
    if parts is None:
        return None
    return {key: value for part in parts for key, value in part.items()}


def whole_on_rank_zero(local: dict[str, Any], replica: int, group: dist.ProcessGroup | None, job: "Job") -> dict | None:
    """The union of replica 0's stages' ``local`` dicts on global rank 0; ``None`` elsewhere. The other replicas
    hold copies of replica 0's, so they send nothing (a collective call of replica 0's pipeline ``group``; ``job``:
    the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the gather uses).

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    if dist.is_initialized() and replica != 0:
        return None
    return gather_union(local, group, job)


def stage_template(module: nn.Module, optimizers: list, fitting: bool) -> dict[str, Any]:
    """What this stage reads of a sharded checkpoint: its model state and, when fitting, its optimizers' state
    (name-keyed, whatever layout this run writes)."""
    template: dict[str, Any] = {"state_dict": module.state_dict()}
    if fitting:
        template["optimizer_states"] = [optimizer_state(module, torch_optimizer(optimizer)) for optimizer in optimizers]
    return template


def save_sharded(checkpoint: dict[str, Any], path: Path, rank: int, job: "Job") -> None:
    """Write ``checkpoint`` as a sharded directory at ``path`` (a collective call), replacing it atomically.

    Args:
        checkpoint: a Lightning checkpoint whose :data:`SHARDED` entries hold this stage's part.
        path: the checkpoint directory.
        rank: this process's global rank; rank 0 writes the metadata and renames the directory.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (its waits and failure board).

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    path = Path(path)
    staging = path.with_name(f".{path.name}.partial")
    if rank == 0 and staging.exists():
        shutil.rmtree(staging)
    collectives.barrier(job)
    with job.board.as_pipeline_failure():
        dcp.save({key: checkpoint[key] for key in SHARDED if key in checkpoint}, checkpoint_id=staging)
    if rank == 0:
        torch.save({key: value for key, value in checkpoint.items() if key not in SHARDED}, staging / METADATA)
        _replace(staging, path)
    collectives.barrier(job)


def load_sharded(path: Path, template: dict[str, Any], job: "Job") -> dict[str, Any]:
    """Read a sharded checkpoint directory: this stage's entries of ``template`` plus the trainer state.

    Args:
        path: the checkpoint directory.
        template: ``{"state_dict": ..., "optimizer_states": [...]}`` of this stage, filled in place.
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose failure board names a failed stage.

    Raises:
        FileNotFoundError: if ``path`` has no :data:`METADATA` file (not a sharded checkpoint).
        PipelineFailure: if another stage failed while this one waited for it.
    """
    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} is not a sharded GPipe checkpoint: it has no {METADATA}.")
    with job.board.as_pipeline_failure():
        dcp.load(template, checkpoint_id=path)
    return {**torch.load(path / METADATA, weights_only=False), **template}


def is_sharded(path: Any) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    return Path(path).is_dir() and (Path(path) / METADATA).is_file()


def _replace(staging: Path, path: Path) -> None:
    previous = path.with_name(f".{path.name}.previous")
    if path.exists():
        path.rename(previous)
    staging.rename(path)
    if previous.exists():
        shutil.rmtree(previous)
