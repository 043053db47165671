"""Distributed worker: the spawn launcher gives the main process every stage's weights.

Usage: python spawn.py OUT_FILE — saves the main process's module state dict after fit.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from models import fit  # noqa: E402

import lightning_gpipe  # noqa: E402

if __name__ == "__main__":
    module = fit(strategy=lightning_gpipe.GPipeStrategy(chunks=3, start_method="spawn"), devices=2)
    torch.save(module.state_dict(), sys.argv[1])
