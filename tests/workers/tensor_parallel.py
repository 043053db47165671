"""Distributed worker: tensor parallelism inside the stages (``tensor_parallel_size``) on 4 processes.

Usage: python tensor_parallel.py OUT_DIR [--runs NAME ...]  (4 processes, started by Lightning's launcher)
Runs every run of :data:`tensor_parallel.RUNS`, :data:`tensor_parallel.MIXED`, :data:`tensor_parallel.TIED` and
:data:`tensor_parallel.CHECKPOINTED` by default. For each, global rank 0 writes OUT_DIR/NAME.pt: its module's whole
state after fit (plain tensors again) and the training loss it saw after every step; every rank of a run of
:data:`tensor_parallel.RUNS` writes OUT_DIR/NAME_rank{r}.pt, what it held during training: its parameters' local and
whole element counts and whether each was a ``DTensor``. A run of :data:`tensor_parallel.CHECKPOINTED` without a source
writes its full checkpoint after 4 steps.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import LossRecorder, trainer_kwargs  # noqa: E402
from sharded import HF_STEPS, ReplicaLosses, ShardsHeld, hf_global_batches, hf_starting_module  # noqa: E402
from tensor_parallel import (  # noqa: E402
    CHECKPOINTED,
    HF_RUNS,
    MIXED,
    RUNS,
    STEPS,
    TIED,
    SplitMLP,
    TiedSplitLM,
    replicas_loader,
)
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_gpipe  # noqa: E402


class HeldInTraining(L.Callback):
    """Writes what this rank holds at the end of training, before the strategy's teardown gathers it whole."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        parameters = list(pl_module.parameters())
        local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parameters)
        split = [isinstance(p, DTensor) for p in parameters]
        torch.save({"local": local, "whole": sum(p.numel() for p in parameters), "split": split}, self.path)


def fit(name: str, out: str, options: dict, overrides: dict, steps: int, resume: str | None = None) -> None:
    """Train :class:`tensor_parallel.SplitMLP` (:class:`tensor_parallel.TiedSplitLM` for a run of
    :data:`tensor_parallel.TIED`) on 4 processes with ``options``; global rank 0 writes NAME.pt."""
    strategy = lightning_gpipe.GPipeStrategy(**options)
    L.seed_everything(1, verbose=False)
    callbacks = [recorder := LossRecorder()]
    if name in RUNS:
        callbacks.append(HeldInTraining(os.path.join(out, f"{name}_rank{os.environ.get('LOCAL_RANK', '0')}.pt")))
    if name in CHECKPOINTED and resume is None:
        callbacks.append(ModelCheckpoint(out, name, every_n_train_steps=steps, enable_version_counter=False))
        overrides = {**overrides, "enable_checkpointing": True}
    trainer = L.Trainer(
        strategy=strategy, devices=4, max_steps=steps, **trainer_kwargs(callbacks=callbacks, **overrides)
    )
    replicas = trainer.strategy.topology.data_parallel_size
    module_class = TiedSplitLM if name in TIED else SplitMLP
    trainer.fit(
        module_class(),
        replicas_loader(replicas, module_class),
        ckpt_path=os.path.join(out, f"{resume}.ckpt") if resume else None,
    )
    if trainer.global_rank == 0:
        state = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
        torch.save({"state": state, "losses": recorder.losses}, os.path.join(out, f"{name}.pt"))


def hf_run(name: str, out: str) -> None:
    """A run of :data:`tensor_parallel.HF_RUNS`: every rank writes OUT_DIR/NAME_rank{r}.pt, its stage's tensors after
    fit (by the model's names, whole again), the losses (on a last stage), and what was split in training."""
    from lightning_gpipe.hf.layer import hf_name

    lora, rank = HF_RUNS[name], int(os.environ.get("LOCAL_RANK", 0))
    L.seed_everything(1, verbose=False)
    module = hf_starting_module(name, out, lora)
    strategy = lightning_gpipe.GPipeStrategy(tensor_parallel_size=2, chunks=3, defer_weight_grad=False)
    callbacks = [losses := ReplicaLosses(), held := ShardsHeld()]
    trainer = L.Trainer(strategy=strategy, devices=4, max_steps=HF_STEPS, **trainer_kwargs(callbacks=callbacks))
    trainer.fit(module, DataLoader(hf_global_batches(), batch_size=None))
    own = {hf_name(k): v for k, v in module.backbone.state_dict().items() if not v.is_meta}
    result = {"state": own, "losses": losses.losses, "split": held.sharded}
    torch.save(result, os.path.join(out, f"{name}_rank{rank}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", nargs="+", default=[*RUNS, *MIXED, *TIED, *CHECKPOINTED, *HF_RUNS])
    args = parser.parse_args()
    for each in args.runs:
        if each in HF_RUNS:
            hf_run(each, args.out)
        elif each in RUNS or each in MIXED or each in TIED:
            fit(each, args.out, *(RUNS.get(each) or MIXED.get(each) or TIED[each]), STEPS)
        else:
            options, resume = CHECKPOINTED[each]
            fit(each, args.out, options, {}, STEPS if resume else 4, resume)
