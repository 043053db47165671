"""Data loaders of a pipeline's stages: every stage must read the same batches, in the same order.

With several pipeline replicas, Lightning gives each loader a ``DistributedSampler`` over the replicas (as for
DDP), which orders the rows from the seed and the epoch, the same on every stage of a replica. With one pipeline
Lightning leaves the loaders as they are, as for one device; :func:`same_batches` then replaces the one sampler
whose order comes from each process's own state, a ``RandomSampler`` without a generator of its own (what
``DataLoader(shuffle=True)`` makes), by a ``DistributedSampler`` with one replica, shuffled from the seed of
``seed_everything`` and the epoch, as Lightning shuffles for DDP; a loader that is not shuffled keeps its order.
Under ``seed_everything(workers=True)`` a loader's worker processes are seeded by data-parallel rank instead of
global rank, so that random augmentation in the workers is the same on every stage.

Every process builds its own datasets (Lightning's launcher runs the user's script once per process), so data made
from randomness nobody seeded (``TensorDataset(torch.randn(...))`` at the top of a script) differs between the stages.
:func:`same_datasets` compares a fingerprint of every loader's dataset (its length and a few items) when a loop
starts, and names that cause. Whatever else could still make the stages read different batches (a custom sampler,
an iterable dataset, a loader the user keeps with ``Trainer(use_distributed_sampler=False)``) is caught by the
stages' batch agreement (:mod:`lightning_gpipe.lightning.agreement`).
"""

import os
from functools import partial
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch.distributed as dist
from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_gpipe._torch import requested_samples
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import with_sampler
from lightning_gpipe.lightning.agreement import BatchMismatchError, fingerprint
from lightning_gpipe.lightning.contract import fixed_seed

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_gpipe.engine import Topology
    from lightning_gpipe.faults import Job

SAMPLED_ITEMS = 3
"""Items of each dataset that go into its fingerprint: the first, the middle and the last."""

SEED_THE_DATA = (
    "Each stage process builds the data itself (Lightning's launcher runs your script once per process), so data"
    " made from randomness nobody seeded, such as `TensorDataset(torch.randn(...))` at the top of a script, differs"
    " between them. Seed before you build the data: call `lightning.seed_everything(SEED)` (or `torch.manual_seed`)"
    " before the dataset is made, or draw it from a generator of its own, `torch.Generator().manual_seed(SEED)`."
)
"""The fix :func:`same_datasets` names."""

LOADERS = {
    "training": "train_dataloader",
    "validation": "val_dataloaders",
    "test": "test_dataloaders",
    "prediction": "predict_dataloaders",
}
"""Each loop's data loaders, as the Trainer attribute that holds them."""


def same_batches(dataloader: object, replica: int, replicas: int, resample: bool) -> object:
    """``dataloader``, or a copy of it, that reads the same batches on every stage of a pipeline.

    Args:
        dataloader: a loader as Lightning prepared it for this process.
        replica: this process's data-parallel rank.
        replicas: the number of pipeline replicas; with more than one, Lightning's own distributed sampler is kept.
        resample: whether the sampler may be replaced (``Trainer(use_distributed_sampler=...)``).
    """
    if resample and replicas == 1 and _draws_from_the_process(dataloader):
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        dataloader = with_sampler(
            dataloader, DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        )
    if getattr(dataloader, "worker_init_fn", False) is None and os.environ.get("PL_SEED_WORKERS") == "1":
        cast(Any, dataloader).worker_init_fn = partial(pl_worker_init_function, rank=replica)  # has one (None)
    return dataloader


def _draws_from_the_process(dataloader: object) -> TypeGuard[DataLoader]:
    """Whether the loader's order comes from the process's global random generator."""
    sampler = getattr(dataloader, "sampler", None)
    return (
        isinstance(dataloader, DataLoader)
        and type(sampler) is RandomSampler
        and sampler.generator is None
        and not sampler.replacement
        and requested_samples(sampler) is None
    )


def same_datasets(trainer: "pl.Trainer", loop: str, topology: "Topology", job: "Job") -> None:
    """Raise on every process alike when the stages of a pipeline hold different datasets for ``loop`` (a collective
    call, when the loop starts): each process fingerprints the dataset of every data loader of the loop
    (:func:`dataset_fingerprint`) and the processes of each replica compare theirs.

    Args:
        trainer: the Trainer, whose loaders for ``loop`` are compared.
        loop: ``"training"``, ``"validation"``, ``"test"`` or ``"prediction"``.
        topology: the job's mesh: which ranks are the stages of one replica, and their names.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (its waits).

    Raises:
        BatchMismatchError: naming each stage's datasets (rows and fingerprint) and the fix (:data:`SEED_THE_DATA`).
        PipelineFailure: if another stage failed while this one waited for it.
    """
    found: list[DataLoader] = []
    apply_to_collection(getattr(trainer, LOADERS[loop]), DataLoader, found.append)
    mine = [(_size(loader.dataset), dataset_fingerprint(loader.dataset)) for loader in found]
    every = waiting.all_gather_object(job, mine) if dist.is_initialized() else [mine]
    first_of_replica: dict[int, list] = {}
    if any(first_of_replica.setdefault(topology.replica_of(r), theirs) != theirs for r, theirs in enumerate(every)):
        held = "; ".join(f"{topology.name(rank)}: {_described(theirs)}" for rank, theirs in enumerate(every))
        raise BatchMismatchError(
            f"The stages of a pipeline hold different {loop} datasets ({held}), so they would read different batches:"
            f" the last stage would pair the first stage's rows with other rows' labels. {SEED_THE_DATA}"
        )


def dataset_fingerprint(dataset: Any) -> Tensor | None:
    """A digest of ``dataset``'s length and of its first, middle and last items (:data:`SAMPLED_ITEMS`), read with
    torch's, NumPy's and Python's generators seeded alike on every process (and put back after:
    :func:`~lightning_gpipe.lightning.contract.fixed_seed`), so that random augmentation in ``__getitem__`` reads
    alike everywhere. ``None`` for a dataset without a length or an iterable one (the stages' batch agreement still
    checks what it yields); the length alone for one whose items cannot be read here.
    """
    size = _size(dataset)
    if size is None or isinstance(dataset, IterableDataset):
        return None
    indices = sorted({0, size // 2, size - 1}) if size else []
    with fixed_seed():
        try:
            items = [dataset[index] for index in indices]
        except Exception:  # noqa: BLE001 - a dataset that only reads in its workers: compared by its length alone
            return fingerprint(size)
    return fingerprint((size, items))


def _size(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _described(datasets: list[tuple[int | None, Tensor | None]]) -> str:
    """``"52 rows (fingerprint 0a1b...)"`` for each of a process's datasets."""
    parts = []
    for size, digest in datasets:
        rows = "no length" if size is None else f"{size:,} rows"
        parts.append(f"{rows} (fingerprint {'-' if digest is None else f'{digest:016x}'})")
    return ", ".join(parts) or "no data loader"
