"""Distributed worker: the default chooses whole backwards or the B/W split once, alike on every stage, and keeps what
the user fixed.

Usage: python default_split.py OUT_DIR --devices K  (run with Lightning's launcher)
Writes OUT_DIR/rank{r}.json: for each set of options, the ``defer_weight_grad`` the stage's engine ran with, whether
the backbone was profiled, and (rank 0) the lines the strategy logged about its choice.
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
from models import fit  # noqa: E402

import lightning_gpipe  # noqa: E402

OPTIONS = {
    "default": {},
    "whole_fixed": {"defer_weight_grad": False},
    "split_fixed": {"defer_weight_grad": True},
    "schedule_fixed": {"schedule": "gpipe"},
}


class Lines(logging.Handler):
    """Keeps the messages about the choice that Lightning's rank-zero logger emits."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "GPipeStrategy chose" in record.getMessage():
            self.lines.append(record.getMessage())


class Ran(L.Callback):
    """Records what the stage's engine was built with (the config ``stage_spec`` read)."""

    def on_train_start(self, trainer, pl_module):
        self.split = trainer.strategy.config.splits_backward


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

lines = Lines()
logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(lines)
record = {}
for name, options in OPTIONS.items():
    strategy, ran, before = lightning_gpipe.GPipeStrategy(chunks=4, **options), Ran(), len(lines.lines)
    fit(strategy=strategy, devices=args.devices, max_steps=1, callbacks=[ran])
    profiled = strategy.layer_costs is not None
    record[name] = {"split": ran.split, "profiled": profiled, "lines": lines.lines[before:]}
with open(os.path.join(args.out, f"rank{strategy.global_rank}.json"), "w") as f:
    json.dump(record, f)
