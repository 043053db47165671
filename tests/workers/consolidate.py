"""Distributed worker: a sharded checkpoint, its consolidated file, and resumes from both.

Usage: python consolidate.py OUT_DIR [--devices K]
Two runs of a freshly seeded TupleNet write a checkpoint at step 3 (the end of the first epoch, where Lightning
resumes exactly), the same state in both layouts: OUT_DIR/full.ckpt (one file) and OUT_DIR/sharded.ckpt (a
directory). Global rank 0 then consolidates the directory in-process (``lightning_gpipe.consolidate.consolidate``)
to OUT_DIR/consolidated.ckpt while the other stages wait, and training resumes to step 6 from the directory
(``state_dict_type="sharded"``) and from the consolidated file (``"full"``). Each resume writes rank 0's module state
after fit to OUT_DIR/resume_{sharded,consolidated}.pt and its per-step training losses (as rank 0 sees them) to
OUT_DIR/losses_{sharded,consolidated}.json.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import LossRecorder, fit_trainer  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.lightning.consolidate import consolidate  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
args = parser.parse_args()


def path(name: str) -> str:
    return os.path.join(args.out, name)


def write_checkpoint(state_dict_type: str) -> None:
    every_3 = ModelCheckpoint(dirpath=args.out, filename=state_dict_type, every_n_train_steps=3, save_top_k=-1)
    strategy = lightning_gpipe.GPipeStrategy(chunks=3, state_dict_type=state_dict_type)
    fit_trainer(strategy, args.devices, max_steps=3, enable_checkpointing=True, callbacks=[every_3])


def resume(name: str, state_dict_type: str, checkpoint: str) -> None:
    losses = LossRecorder()
    strategy = lightning_gpipe.GPipeStrategy(chunks=3, state_dict_type=state_dict_type)
    trainer = fit_trainer(strategy, args.devices, max_steps=6, ckpt_path=path(checkpoint), callbacks=[losses])
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), path(f"resume_{name}.pt"))
        with open(path(f"losses_{name}.json"), "w") as f:
            json.dump(losses.losses, f)


for kind in ("full", "sharded"):
    write_checkpoint(kind)
if dist.get_rank() == 0:
    try:
        consolidate(path("sharded.ckpt"), path("consolidated.ckpt"))
    finally:
        dist.barrier()  # reached even if consolidating failed, so the resumes fail on every stage instead of hanging
else:
    dist.barrier()
resume("sharded", "sharded", "sharded.ckpt")
resume("consolidated", "full", "consolidated.ckpt")
