"""Distributed worker: sharded data parallelism (FSDP2 over each stage's replicas) on a (2 stages x 2 replicas) mesh.

Usage: python sharding.py OUT_DIR [--runs NAME ...]  (4 processes, started by Lightning's launcher)
Runs every run of :data:`sharded.RUNS`, :data:`sharded.MIXED`, :data:`sharded.CHECKPOINTED` and
:data:`sharded.HF_RUNS` by default (those of
:data:`sharded.VALIDATED` validating after every epoch). For each, global rank 0 writes OUT_DIR/NAME.pt: its module's
whole state after fit (plain tensors again) and the ``sync_dist=True`` training loss it saw after every batch, and but
for :data:`sharded.CHECKPOINTED` whether a validation loss was logged. For each run of :data:`sharded.RUNS` and
:data:`sharded.MIXED`, every rank writes OUT_DIR/NAME_rank{r}.pt, what it held at the end of training: its
parameters' local and whole element counts, whether each was a ``DTensor``, the elements of its optimizer state, and
the all-gathers and reduce-scatters FSDP2 called in each training batch. A run of :data:`sharded.CHECKPOINTED` of 4
steps writes its checkpoint OUT_DIR/NAME.ckpt. A run of :data:`sharded.HF_RUNS` (a Hugging Face Llama) writes
OUT_DIR/NAME_rank{r}.pt on every rank (see :func:`hf_run`).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import GLOBAL_BATCH, LossRecorder, loader, trainer_kwargs  # noqa: E402
from sharded import (  # noqa: E402
    CHECKPOINTED,
    HF_RUNS,
    HF_STEPS,
    MIXED,
    RUNS,
    STEPS,
    VALIDATED,
    AdamWNet,
    ReplicaLosses,
    ShardsHeld,
    dataset_of,
    hf_rows,
    hf_starting_module,
    reference_loader,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_gpipe  # noqa: E402

COUNTS = {"all_gather": 0, "reduce_scatter": 0}
"""FSDP2's collectives (``dist.all_gather_single``, ``dist.reduce_scatter_single``) this process has called so far."""


def _counting(name: str, collective):
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return collective(*args, **kwargs)

    return counted


dist.all_gather_single = _counting("all_gather", dist.all_gather_single)
dist.reduce_scatter_single = _counting("reduce_scatter", dist.reduce_scatter_single)


class CollectivesPerBatch(L.Callback):
    """Keeps FSDP2's all-gathers and reduce-scatters of each training batch (its step, and its optimizer step)."""

    def __init__(self) -> None:
        self.counts: list[tuple[int, int]] = []

    def on_train_batch_start(self, *_) -> None:
        self.start = dict(COUNTS)

    def on_train_batch_end(self, *_) -> None:
        self.counts.append(tuple(COUNTS[name] - self.start[name] for name in ("all_gather", "reduce_scatter")))


class HeldAtTrainEnd(L.Callback):
    """Writes what this rank holds when training ends, before the strategy's teardown gathers it whole."""

    def __init__(self, path: str, collectives: CollectivesPerBatch) -> None:
        self.path, self.collectives = path, collectives

    def on_train_end(self, trainer, pl_module) -> None:
        parameters = list(pl_module.parameters())
        optimizer = trainer.optimizers[0]
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        torch.save(
            {
                "local": sum(_local(p).numel() for p in parameters),
                "whole": sum(p.numel() for p in parameters),
                "dtensor": [isinstance(p, DTensor) for p in parameters],
                "optimizer": sum(_local(t).numel() for t in states),
                "collectives": self.collectives.counts,
            },
            self.path,
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def run(name: str, out: str) -> None:
    module_class, options, overrides = {**RUNS, **MIXED}[name]
    strategy = lightning_gpipe.GPipeStrategy(pipeline_parallel_size=2, data_parallel_size=2, **options)
    L.seed_everything(1, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    counts = CollectivesPerBatch()
    callbacks = [recorder := LossRecorder(), counts, HeldAtTrainEnd(os.path.join(out, f"{name}_rank{rank}.pt"), counts)]
    trainer = L.Trainer(
        strategy=strategy, devices=4, max_steps=STEPS, **trainer_kwargs(callbacks=callbacks, **overrides)
    )
    validation = loader(seed=1) if name in VALIDATED else None
    trainer.fit(module_class(), DataLoader(dataset_of(module_class), batch_size=GLOBAL_BATCH // 2), validation)
    if trainer.global_rank == 0:
        state = trainer.lightning_module.state_dict()
        validated = "val_loss" in trainer.callback_metrics
        torch.save({"state": state, "losses": recorder.losses, "validated": validated}, os.path.join(out, f"{name}.pt"))


def checkpointed(name: str, out: str) -> None:
    """A run of :data:`sharded.CHECKPOINTED`: written at its end, or resumed from another's checkpoint."""
    pp, dp, sharding, layout, resume, steps = CHECKPOINTED[name]
    strategy = lightning_gpipe.GPipeStrategy(
        pipeline_parallel_size=pp, data_parallel_size=dp, sharding_strategy=sharding, state_dict_type=layout
    )
    L.seed_everything(1, verbose=False)
    callbacks, overrides = [recorder := LossRecorder()], {}
    if resume is None:
        callbacks.append(ModelCheckpoint(out, name, every_n_train_steps=steps, enable_version_counter=False))
        overrides = {"enable_checkpointing": True}
    trainer = L.Trainer(
        strategy=strategy, devices=4, max_steps=steps, **trainer_kwargs(callbacks=callbacks, **overrides)
    )
    data = DataLoader(loader().dataset, batch_size=GLOBAL_BATCH // dp) if dp > 1 else reference_loader(loader().dataset)
    trainer.fit(AdamWNet(), data, ckpt_path=os.path.join(out, f"{resume}.ckpt") if resume else None)
    if trainer.global_rank == 0:
        state = trainer.lightning_module.state_dict()
        torch.save({"state": state, "losses": recorder.losses}, os.path.join(out, f"{name}.pt"))


def hf_run(name: str, out: str) -> None:
    """A run of :data:`sharded.HF_RUNS`: every rank writes OUT_DIR/NAME_rank{r}.pt, its stage's tensors after fit (by
    the model's names), its replica's losses (on a last stage) and how many of the stage's parameters were
    ``DTensor`` shards at the end of training, of how many."""
    from lightning_gpipe.hf.layer import hf_name

    lora, rank = HF_RUNS[name], int(os.environ.get("LOCAL_RANK", 0))
    L.seed_everything(1, verbose=False)  # the distributed sampler's shuffle: sharded.hf_global_batches'
    module = hf_starting_module(name, out, lora)
    strategy = lightning_gpipe.GPipeStrategy(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        sharding_strategy="FULL_SHARD",
        chunks=3,
        defer_weight_grad=False,  # not chosen by timing: the same run every time
    )
    callbacks = [losses := ReplicaLosses(), held := ShardsHeld()]
    trainer = L.Trainer(strategy=strategy, devices=4, max_steps=HF_STEPS, **trainer_kwargs(callbacks=callbacks))
    trainer.fit(module, DataLoader(hf_rows(), batch_size=3))
    own = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    result = {"state": own, "losses": losses.losses, "sharded": held.sharded}
    torch.save(result, os.path.join(out, f"{name}_rank{rank}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", nargs="+", default=[*RUNS, *MIXED, *CHECKPOINTED, *HF_RUNS])
    args = parser.parse_args()
    for each in args.runs:
        (checkpointed if each in CHECKPOINTED else hf_run if each in HF_RUNS else run)(each, args.out)
