"""Distributed worker: the translation example's tiny Transformer trained and decoded on K pipeline stages.

Usage: python translation.py OUT_DIR --devices K  (run with Lightning's launcher)
Writes OUT_DIR/losses.pt (the per-step training losses rank 0 saw, relayed from the last stage),
OUT_DIR/state.pt (rank 0's module after fit: the full state dict) and OUT_DIR/translations_rank{r}.pt
(what `trainer.predict` returns on each rank for each decoding of tiny_translation.DECODINGS: a dict of
name to the batches' translations through the pipeline).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from tiny_translation import DECODINGS, fit_tiny, predict_data, tiny_trainer  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

strategy = lightning_gpipe.GPipeStrategy(chunks=3)
module, losses = fit_tiny(strategy=strategy, devices=args.devices)
rank = strategy.global_rank
if rank == 0:
    torch.save(losses, os.path.join(args.out, "losses.pt"))
    torch.save(module.state_dict(), os.path.join(args.out, "state.pt"))
translations = {}
for name, decoding in DECODINGS.items():
    for attribute, value in decoding.items():
        setattr(module, attribute, value)
    trainer = tiny_trainer(strategy=lightning_gpipe.GPipeStrategy(chunks=2), devices=args.devices)
    translations[name] = trainer.predict(module, predict_data())
torch.save(translations, os.path.join(args.out, f"translations_rank{rank}.pt"))
