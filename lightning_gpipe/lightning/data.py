"""Data loaders of a pipeline's stages: every stage must read the same batches, in the same order.

With several pipeline replicas, Lightning gives each loader a ``DistributedSampler`` over the replicas (as for
DDP), which orders the rows from the seed and the epoch, the same on every stage of a replica. With one pipeline
Lightning leaves the loaders as they are, as for one device; :func:`same_batches` then replaces the one sampler
whose order comes from each process's own state, a ``RandomSampler`` without a generator of its own (what
``DataLoader(shuffle=True)`` makes), by a ``DistributedSampler`` with one replica, shuffled from the seed of
``seed_everything`` and the epoch, as Lightning shuffles for DDP; a loader that is not shuffled keeps its order.
Under ``seed_everything(workers=True)`` a loader's worker processes are seeded by data-parallel rank instead of
global rank, so that random augmentation in the workers is the same on every stage.

Whatever else could still make the stages read different batches (a custom sampler, an iterable dataset, a
loader the user keeps with ``Trainer(use_distributed_sampler=False)``) is caught by the stages' batch agreement
(:mod:`lightning_gpipe.lightning.agreement`).
"""

import os
from functools import partial

from lightning.fabric.utilities.seed import pl_worker_init_function
from lightning.pytorch.utilities.data import _update_dataloader
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler


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
        dataloader = _update_dataloader(
            dataloader, DistributedSampler(dataloader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        )
    if getattr(dataloader, "worker_init_fn", False) is None and os.environ.get("PL_SEED_WORKERS") == "1":
        dataloader.worker_init_fn = partial(pl_worker_init_function, rank=replica)
    return dataloader


def _draws_from_the_process(dataloader: object) -> bool:
    """Whether the loader's order comes from the process's global random generator."""
    sampler = getattr(dataloader, "sampler", None)
    return (
        isinstance(dataloader, DataLoader)
        and type(sampler) is RandomSampler
        and sampler.generator is None
        and not sampler.replacement
        and sampler._num_samples is None
    )
