"""Distributed worker: the tiny timm models of tests/timm_families.py fine-tuned through ``lightning_gpipe.timm``'s
``ImageClassifier`` (its backbone ``to_sequential``'s, no user wrapper) on 2 stages, one case after another.

Usage: python timm_models.py OUT_DIR [--sharded]
Every case of :data:`CASES` (family, schedule, optimizer) fits ``STEPS`` steps of ``BATCH`` rows in ``CHUNKS``
micro-batches on 2 stages (split by profiled time for the families of :data:`PROFILED`); global rank 0 writes
OUT_DIR/{family}_{schedule}.pt, the module's state dict after fit.
``--sharded`` instead runs :data:`SHARDED` on a (2 stages x 2 replicas) mesh whose stages FSDP2 shards over their
replicas (``sharding_strategy="FULL_SHARD"``; 4 processes, each replica reading half of every batch's rows), written
to OUT_DIR/{family}_sharded.pt. tests/distributed/test_timm.py compares them with one device.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchvision_cpu import make_importable  # noqa: E402

make_importable()  # lightning imports torchmetrics, and timm, torchvision

import lightning as L  # noqa: E402
import torch  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from timm_families import BATCH, CHUNKS, FAMILIES, STEPS, classifier, data  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_gpipe  # noqa: E402

CASES = [
    (family, schedule, "sgd" if schedule == "gpipe" else "adamw")
    for family in FAMILIES
    for schedule in ("gpipe", "1f1b")
]
"""Every family under fill-drain with SGD and under 1F1B with AdamW."""

PROFILED = ("resnet", "swin")
"""The families split by profiled time (``balance="time"``: each layer profiled alone), the others by parameters."""

SHARDED = ("vit", "adamw")
"""The family and optimizer of the sharded run."""


def fit(family: str, optimizer: str, out: str, name: str, devices: int, **options) -> None:
    """Fit the family's ``ImageClassifier`` on ``devices`` processes with ``GPipeStrategy(**options)``; global rank 0
    writes its parameters to OUT/NAME.pt."""
    L.seed_everything(0, verbose=False)
    module = classifier(family, optimizer)
    strategy = lightning_gpipe.GPipeStrategy(chunks=CHUNKS, **options)
    trainer = L.Trainer(strategy=strategy, devices=devices, max_steps=STEPS, **trainer_kwargs())
    trainer.fit(module, DataLoader(data(), batch_size=BATCH * 2 // devices))
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(out, f"{name}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sharded", action="store_true")
    args = parser.parse_args()
    if args.sharded:
        family, optimizer = SHARDED
        options = dict(pipeline_parallel_size=2, data_parallel_size=2, sharding_strategy="FULL_SHARD")
        fit(family, optimizer, args.out, f"{family}_sharded", 4, **options)
    for family, schedule, optimizer in [] if args.sharded else CASES:
        balance = "time" if family in PROFILED else None
        fit(family, optimizer, args.out, f"{family}_{schedule}", 2, schedule=schedule, balance=balance)
