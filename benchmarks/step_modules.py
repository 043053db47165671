"""How many of the package's modules one training step opens: the modules of ``lightning_gpipe`` whose functions run
between Lightning's ``on_train_batch_start`` and ``on_before_optimizer_step`` (the step's forward, loss, backward
and the optimizer step's wrapper up to the optimizer's own step), on each stage, in the main thread (the helper
threads of the interruptible waits and the watchdog are left out).

A small MLP (benchmarks/models.py) on K CPU processes, one steady step (the third) watched with ``sys.setprofile``.
A reader of the code follows one step through these modules: fewer is easier to read.

Usage::

    python benchmarks/step_modules.py                      # fill-drain, K=2, M=4
    python benchmarks/step_modules.py --schedule 1f1b      # a loss per micro-batch
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from models import MLPClassifier, mlp_batch, repeat_loader

from lightning_gpipe import GPipeStrategy

PACKAGE = "lightning_gpipe"
WATCHED_STEP = 2


class _Watch(pl.Callback):
    """Records the package modules whose functions are called during step ``WATCHED_STEP`` into ``out``."""

    def __init__(self, out: Path) -> None:
        self.out, self.modules = out, set()

    def _profile(self, frame, event, arg):  # sys.setprofile's signature
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                self.modules.add(name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == WATCHED_STEP:
            sys.setprofile(self._profile)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == WATCHED_STEP:
            sys.setprofile(None)
            rank = trainer.global_rank
            (self.out / f"rank{rank}.json").write_text(json.dumps(sorted(self.modules)))


def main() -> None:
    """Run the watched fit and print each stage's modules and their count, by layer."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="K, stages (default 2)")
    parser.add_argument("--chunks", type=int, default=4, help="M (default 4)")
    parser.add_argument("--schedule", default="gpipe", help="the schedule (default gpipe: fill-drain)")
    parser.add_argument("--out", default=os.environ.get("STEP_MODULES_OUT") or tempfile.mkdtemp())
    args = parser.parse_args()
    os.environ["STEP_MODULES_OUT"] = args.out  # the launched stages write where the launching one reads
    out = Path(args.out)
    torch.manual_seed(0)
    module = MLPClassifier(width=64, depth=8)
    loader = repeat_loader(mlp_batch(64, width=64), WATCHED_STEP + 2)
    strategy = GPipeStrategy(chunks=args.chunks, schedule=args.schedule, checkpoint="never")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        max_steps=WATCHED_STEP + 2,
        callbacks=[_Watch(out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    if trainer.global_rank != 0:
        return
    for rank in range(args.devices):
        modules = json.loads((out / f"rank{rank}.json").read_text())
        layers = {}
        for name in modules:
            layers.setdefault(name.split(".")[1] if "." in name else "(top)", []).append(name)
        counts = ", ".join(f"{layer} {len(names)}" for layer, names in sorted(layers.items()))
        print(f"stage {rank} ({args.schedule}): {len(modules)} modules ({counts})")
        for name in modules:
            print(f"  {name}")


if __name__ == "__main__":
    main()
