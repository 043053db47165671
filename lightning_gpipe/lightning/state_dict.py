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
- ``"sharded"``: a checkpoint directory written by :mod:`torch.distributed.checkpoint`, each stage
  writing its own tensors, plus ``meta.pt`` with the trainer state (loops, callbacks,
  schedulers). It is written under a temporary name and renamed once complete.

Loading checks the checkpoint's model state against the whole model, every stage's entries (the unsplit module's
names), on every stage alike (:func:`check_model_state`): with Lightning's ``strict`` loading a key of no stage or a
key no stage finds fails as it does without a pipeline, and a shape that differs always does. A damaged file (a
truncated copy) is named (:func:`reading`, :func:`read_metadata`).
"""

import os
import pickle
import shutil
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import torch_optimizer

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job

METADATA = "meta.pt"
"""File of a checkpoint directory (``"sharded"``) holding everything but the model and optimizer state."""

PER_STAGE = ("state_dict", "optimizer_states")
"""Entries of a Lightning checkpoint that each stage holds its own part of."""

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)

DCP_METADATA = ".metadata"
"""torch.distributed.checkpoint's file of a checkpoint directory: what each shard file holds, and where."""

Shapes = dict[str, torch.Size | None]
"""A model's state-dict keys and the shape of each entry (``None``: an entry that is not a tensor)."""


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file is damaged or truncated (e.g. an interrupted copy); the message names the file."""


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
        ValueError: if ``state`` holds nothing of one of this stage's parameters (a checkpoint of another model,
            loaded with ``strict_loading=False``), naming them.
    """
    if not _has_parameters(optimizer):
        return
    groups = [key for key in optimizer_state(module, optimizer) if key.startswith("param_groups.")]
    absent = [key.removeprefix("param_groups.") for key in groups if key not in state]
    missing = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in absent))  # the parameters, not their options
    if missing:
        raise ValueError(
            f"The checkpoint holds no optimizer state of {', '.join(missing)}: it was written by another model. Its"
            " weights may load with `strict_loading=False`, its optimizer state cannot; load the weights alone"
            " (e.g. `Module.load_from_checkpoint(path, strict=False)`) and train from there."
        )
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


def local_entries(state_dict: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """The entries of the whole model's ``state_dict`` that belong to this stage's ``module``.

    Entries of other stages are dropped: check the whole ``state_dict`` against the whole model first
    (:func:`check_model_state`), where a key of no stage is named.
    """
    local = module.state_dict().keys()
    return {key: value for key, value in state_dict.items() if key in local}


def model_shapes(module: nn.Module) -> Shapes:
    """This stage's state-dict keys and their shapes (its part of the model, under the original names)."""
    return {key: value.shape if isinstance(value, Tensor) else None for key, value in module.state_dict().items()}


def whole_model_shapes(module: nn.Module, job: "Job") -> Shapes:
    """The whole model's state-dict keys and their shapes: the union of every stage's :func:`model_shapes`, which
    are the unsplit module's (a collective call of every process; ``job``: the run's
    :class:`~lightning_gpipe.faults.job.Job`, whose waits it uses).

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    local = model_shapes(module)
    if not dist.is_initialized():
        return local
    return {key: shape for part in waiting.all_gather_object(job, local) for key, shape in part.items()}


def check_model_state(state_dict: Mapping[str, Any], shapes: Shapes, strict: bool, model: str) -> None:
    """Check a checkpoint's model ``state_dict`` against the whole model's ``shapes`` (:func:`whole_model_shapes`)
    as ``torch.nn.Module.load_state_dict`` checks a module's, with its message.

    Args:
        state_dict: the checkpoint's model state (a sharded checkpoint's other stages' entries as meta tensors).
        shapes: the whole model's keys and shapes.
        strict: whether a key of the model missing from ``state_dict`` or a key of no stage in it is an error
            (Lightning's ``LightningModule.strict_loading``); a shape that differs always is.
        model: the module's class name, for the message.

    Raises:
        RuntimeError: ``Error(s) in loading state_dict for MODEL:`` and, one per line, ``Missing key(s) in
            state_dict: "backbone.4.weight", ...``, ``Unexpected key(s) in state_dict: ...`` and ``size mismatch for
            KEY: copying a param with shape ... from checkpoint, the shape in current model is ...``.
    """
    saved = {key: value.shape for key, value in state_dict.items() if isinstance(value, Tensor)}
    errors = [
        f"size mismatch for {key}: copying a param with shape {saved[key]} from checkpoint, the shape in current"
        f" model is {shape}."
        for key, shape in shapes.items()  # in the model's order, as torch names them
        if shape is not None and key in saved and saved[key] != shape
    ]
    if strict:
        unexpected = [key for key in state_dict if key not in shapes]
        missing = [key for key in shapes if key not in state_dict]
        if unexpected:
            errors.insert(0, f"Unexpected key(s) in state_dict: {_quoted(unexpected)}. ")
        if missing:
            errors.insert(0, f"Missing key(s) in state_dict: {_quoted(missing)}. ")
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {model}:\n\t" + "\n\t".join(errors))


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def gather_union(local: dict[str, Any], group: dist.ProcessGroup | None, job: "Job") -> dict[str, Any] | None:
    """The union of the ``local`` dicts of every process of ``group`` (``None``: all) on global rank 0, ``None``
    elsewhere (a collective call of ``group``, which must hold global rank 0; ``job``: the run's
    :class:`~lightning_gpipe.faults.job.Job`, whose waits the gather uses).

    An entry several processes hold (a tied parameter's copies) comes from the last of them, and crosses once; a dense
    tensor crosses as its own bytes (:func:`~lightning_gpipe.faults.waiting.gather_tensors`), the other values
    pickled. So global rank 0 holds, beside its own state, the union and no copy of it (a whole model gathered after
    fit fits where the model did), and the others nothing more. The result's tensors are on the CPU, so it is
    device-independent.

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    if not dist.is_initialized():
        return {key: _on_cpu(value) for key, value in local.items()}
    every = waiting.all_gather_object(job, list(local), group)
    giver = {key: index for index, keys in enumerate(every) for key in keys}  # the last process holding it
    mine = [key for key in local if giver[key] == dist.get_rank(group)]
    others = {key: _on_cpu(local[key]) for key in mine if not _dense(local[key])}
    pickled = waiting.gather_object(job, others, 0, group)
    tensors = waiting.gather_tensors(job, [local[key] for key in mine if key not in others], 0, group)
    if pickled is None or tensors is None:
        return None
    union = dict.fromkeys(key for keys in every for key in keys)
    for index, keys in enumerate(every):
        received = iter(tensors[index])
        for key in (key for key in keys if giver[key] == index):
            union[key] = pickled[index][key] if key in pickled[index] else next(received)
    return union


def _dense(value: Any) -> bool:
    """Whether ``value`` is a plain dense tensor, which crosses as its own bytes."""
    plain = type(value) in (Tensor, nn.Parameter)
    return plain and value.layout == torch.strided and not value.is_quantized and not value.is_meta


def _on_cpu(value: Any) -> Any:
    return value.cpu() if isinstance(value, Tensor) else value


def whole_on_rank_zero(
    local: dict[str, Any], pipeline: int, group: dist.ProcessGroup | None, job: "Job"
) -> dict | None:
    """The union of pipeline 0's stages' ``local`` dicts on global rank 0; ``None`` elsewhere. The other pipelines
    (replicas, and tensor ranks once their tensors are whole) hold copies of pipeline 0's, so they send nothing (a
    collective call of pipeline 0's ``group``; ``job``: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits
    the gather uses; ``pipeline``: :meth:`~lightning_gpipe.engine.Topology.pipeline_of` this process).

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    if dist.is_initialized() and pipeline != 0:
        return None
    return gather_union(local, group, job)


def stage_template(module: nn.Module, optimizers: list, fitting: bool) -> dict[str, Any]:
    """What this stage reads of a checkpoint directory: its model state and, when fitting, its optimizers' state
    (name-keyed, whatever layout this run writes)."""
    template: dict[str, Any] = {"state_dict": module.state_dict()}
    if fitting:
        template["optimizer_states"] = [optimizer_state(module, torch_optimizer(optimizer)) for optimizer in optimizers]
    return template


def save_directory(checkpoint: dict[str, Any], path: Path, rank: int, job: "Job") -> None:
    """Write ``checkpoint`` as a checkpoint directory at ``path`` (``"sharded"``; a collective call), replacing it
    atomically.

    Args:
        checkpoint: a Lightning checkpoint whose :data:`PER_STAGE` entries hold this stage's part.
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
    waiting.barrier(job)
    with job.board.as_pipeline_failure():
        dcp.save({key: checkpoint[key] for key in PER_STAGE if key in checkpoint}, checkpoint_id=staging)
    if rank == 0:
        torch.save({key: value for key, value in checkpoint.items() if key not in PER_STAGE}, staging / METADATA)
        _replace(staging, path)
    waiting.barrier(job)


def load_directory(path: Path, template: dict[str, Any], job: "Job") -> dict[str, Any]:
    """Read a checkpoint directory (``"sharded"``): this stage's entries of ``template``, the trainer state, and the
    other stages' model entries as meta tensors of their saved shape and dtype, so that the model state can be checked
    against the whole model (:func:`check_model_state`) as a full checkpoint's is.

    Only the entries of ``template`` that the checkpoint holds with the same shape are read; the model entries it
    lacks stay missing, and those of another shape are meta tensors of the saved shape, for that check to name.

    Args:
        path: the checkpoint directory.
        template: ``{"state_dict": ..., "optimizer_states": [...]}`` of this stage (see :func:`stage_template`).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose failure board names a failed stage.

    Raises:
        FileNotFoundError: if ``path`` has no :data:`METADATA` file (not a sharded checkpoint), or a shard file is
            missing.
        DamagedCheckpointError: if a file of the checkpoint is damaged or truncated, naming it.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"{path} is not a sharded GPipe checkpoint: it has no {METADATA}.")
    saved = _saved_entries(read_metadata(path))
    held = _held(template, saved)
    with job.board.as_pipeline_failure():
        dcp.load(held, checkpoint_id=path)
    with reading(path / METADATA):
        trainer_state = torch.load(path / METADATA, weights_only=False)
    model = {
        key[1]: held["state_dict"][key[1]] if key[1] in held["state_dict"] else _placeholder(entry)
        for key, entry in saved.items()
        if key[0] == "state_dict" and len(key) == 2
    }
    return {**trainer_state, **held, "state_dict": model}


def read_metadata(path: Path) -> Metadata:
    """The torch.distributed.checkpoint metadata of the sharded checkpoint directory ``path``, its shard files
    checked to hold every byte it places in them.

    Raises:
        FileNotFoundError: if ``path`` has no metadata file, or a shard file is missing.
        DamagedCheckpointError: if the metadata file is damaged, or a shard file is truncated, naming it.
    """
    path = Path(path)
    with reading(path / DCP_METADATA):
        metadata = FileSystemReader(path).read_metadata()
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        shard = path / name
        if not shard.is_file():
            raise FileNotFoundError(f"{shard} is missing: the sharded checkpoint {path} is incomplete.")
        size = shard.stat().st_size
        if size < end:
            raise DamagedCheckpointError(
                f"The checkpoint file {shard} is damaged or truncated: it holds {size} bytes, where the checkpoint's"
                f" {DCP_METADATA} places data up to byte {end}. Copy the whole directory again, or resume from"
                " another checkpoint."
            )
    return metadata


def _saved_entries(metadata: Metadata) -> dict[tuple, Any]:
    """What a sharded checkpoint holds, by path in the checkpoint's dictionary (``("state_dict", "backbone.0.weight")``,
    ``("optimizer_states", 0, "state.backbone.0.weight.exp_avg")``): each entry's ``TensorStorageMetadata`` (shape,
    dtype) or ``BytesStorageMetadata`` (any other value)."""
    return {tuple(key): metadata.state_dict_metadata[name] for name, key in metadata.planner_data.items()}


def _held(template: dict[str, Any], saved: dict[tuple, Any]) -> dict[str, Any]:
    """The entries of ``template`` that the checkpoint holds (``saved``) with their shape; no optimizer state if the
    checkpoint has none (weights only), so that Lightning says so."""
    held: dict[str, Any] = {"state_dict": _fitting(template["state_dict"], ("state_dict",), saved)}
    if "optimizer_states" in template and any(key[0] == "optimizer_states" for key in saved):
        optimizers = enumerate(template["optimizer_states"])
        held["optimizer_states"] = [_fitting(state, ("optimizer_states", i), saved) for i, state in optimizers]
    return held


def _fitting(entries: dict[str, Any], prefix: tuple, saved: dict[tuple, Any]) -> dict[str, Any]:
    """The ``entries`` saved under ``prefix`` as what they are: a tensor of their shape, or another value."""
    fitting = {}
    for key, value in entries.items():
        entry = saved.get((*prefix, key))
        if isinstance(value, Tensor):
            fits = isinstance(entry, TensorStorageMetadata) and entry.size == value.shape
        else:
            fits = isinstance(entry, BytesStorageMetadata)
        if fits:
            fitting[key] = value
    return fitting


def _placeholder(entry: Any) -> Tensor | None:
    """A meta tensor of a saved tensor's shape and dtype (``None`` for another value): an entry not read here."""
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
    return None


@contextmanager
def reading(path: str | os.PathLike) -> Iterator[None]:
    """Read the checkpoint file ``path`` inside the block: an error it raises because the file is damaged (empty, a
    zip archive, torch's format, that is truncated or corrupted, or a pickle that ends too soon) becomes a
    :class:`DamagedCheckpointError` naming the file.

    Raises:
        DamagedCheckpointError: for a damaged file, with the reader's error as its cause; the reader's error
            otherwise.
    """
    try:
        yield
    except Exception as error:
        damage = _damage(Path(path), error)
        if damage is None:
            raise
        raise DamagedCheckpointError(
            f"The checkpoint file {path} is damaged or truncated: {damage}; reading it failed with"
            f" {type(error).__name__}: {error}. Resume from another checkpoint, or copy this one again."
        ) from error


def _damage(path: Path, error: Exception) -> str | None:
    """What is wrong with the checkpoint file ``path`` that its reader failed on with ``error``, if it is damaged;
    ``None`` if nothing is seen (no such local file, an intact zip archive, or another error)."""
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size == 0:
        return "it is empty"
    with path.open("rb") as file:
        zipped = file.read(4) == b"PK\x03\x04"
    if not zipped:  # a pickle (torch.distributed.checkpoint's metadata, torch's legacy format)
        ended = isinstance(error, EOFError) or isinstance(error, pickle.UnpicklingError) and "truncated" in str(error)
        return f"its data ends at byte {size}, too soon" if ended else None
    try:
        with zipfile.ZipFile(path) as archive:
            corrupted = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError):
        return f"its {size} bytes are not a complete zip archive (torch's format)"
    return None if corrupted is None else f"its entry {corrupted} is corrupted"


def _replace(staging: Path, path: Path) -> None:
    previous = path.with_name(f".{path.name}.previous")
    if path.exists():
        path.rename(previous)
    staging.rename(path)
    if previous.exists():
        shutil.rmtree(previous)
