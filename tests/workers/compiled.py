"""Distributed worker: GPipeStrategy(compile=...) on 2 stages under schedule="zb-h1" with re-materialization, so
stage 1 splits each compiled backward into B and W (torch's own zero-bubble schedules refuse compiled stages,
pytorch/pytorch#161904).

Usage: python compiled.py OUT_DIR --devices 2
Writes rank 0's module state after the fit to OUT_DIR/zb_h1.pt (the test, tests/distributed/test_compile.py,
compares it with one device), and OUT_DIR/compiled_rank{r}.json: how many backbone layers the stage holds, how many
of them were compiled during the fit, and how many still are after it.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from models import TupleNet  # noqa: E402
from rowwise import fit_batches  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.engine.compilation import is_compiled  # noqa: E402

BLOCKS, STEPS = 2, 2
"""A small TupleNet (4 backbone layers, 2 per stage) for 2 steps of 20 rows: compiling is the slow part."""

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()
rank = int(os.environ.get("LOCAL_RANK", "0"))


class Seen(L.Callback):
    """Counts the stage's backbone layers, and the compiled ones, at the first training batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            layers = list(trainer.strategy.run.partition.children())
            self.compiled, self.layers = sum(is_compiled(layer) for layer in layers), len(layers)


seen = Seen()
strategy = lightning_gpipe.GPipeStrategy(chunks=3, checkpoint="always", schedule="zb-h1", compile={"dynamic": False})
trainer = fit_batches(strategy, args.devices, module=lambda: TupleNet(blocks=BLOCKS), max_steps=STEPS, callbacks=[seen])
module = trainer.lightning_module
if trainer.global_rank == 0:
    torch.save(module.state_dict(), os.path.join(args.out, "zb_h1.pt"))
with open(os.path.join(args.out, f"compiled_rank{rank}.json"), "w") as f:
    after = sum(is_compiled(layer) for layer in module.backbone)
    json.dump({"layers": seen.layers, "compiled": seen.compiled, "after": after}, f)
