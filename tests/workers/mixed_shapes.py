"""Distributed worker: 2 stages, 4 micro-batches, batches whose micro-batches mix new and known shapes (fill-drain
and 1F1B; and ``channels_last`` images under ZB-H1).

Usage: python mixed_shapes.py OUT_DIR
Writes OUT_DIR/<schedule>.pt, rank 0's module state after fit.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from mixed_batches import fit  # noqa: E402

import lightning_gpipe  # noqa: E402

for schedule in ("gpipe", "1f1b", "zb-h1"):
    images = schedule == "zb-h1"  # channels_last activations and gradients across the boundary, B and W apart
    trainer = fit(lightning_gpipe.GPipeStrategy(chunks=4, checkpoint="never", schedule=schedule), 2, images)
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(sys.argv[1], f"{schedule}.pt"))
