"""Distributed worker: GPipeStrategy(plan="auto", virtual_stages=2) profiles on rank 0, every stage runs the same
chosen plan (two model chunks per stage: the planner keeps what the user fixed, and the strategy runs it).

Usage: python planning.py OUT_DIR --devices K  (run with Lightning's launcher)
Writes OUT_DIR/rank{r}.json: the plan report, the names of the stage's local layers, the options the strategy ran
with, and (rank 0) whether training under plan="auto" gives the same weights as training with the chosen options
given explicitly.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from models import fit  # noqa: E402

import lightning_gpipe  # noqa: E402


class LocalLayers(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.names = list(pl_module.backbone._modules)


def train(devices: int, **options):
    strategy = lightning_gpipe.GPipeStrategy(**options)
    local = LocalLayers()
    module = fit(strategy=strategy, devices=devices, max_steps=2, callbacks=[local])
    return strategy, local.names, module.state_dict()


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

planned, names, planned_state = train(args.devices, plan="auto", memory_limit=2**30, virtual_stages=2)
chosen = planned.plan_report.chosen.plan
options = {key: chosen.options()[key] for key in ("chunks", "checkpoint", "schedule", "virtual_stages")}
_, _, given_state = train(args.devices, balance=list(chosen.balance), **options)
record = {
    "report": planned.plan_report.as_dict(),
    "local": names,
    "ran": {"balance": planned.config.balance, **{key: getattr(planned.config, key) for key in options}},
    "same_as_given": planned.global_rank == 0  # the whole model is on rank 0 after fit
    and all(torch.equal(planned_state[k], given_state[k]) for k in given_state),
}
with open(os.path.join(args.out, f"rank{planned.global_rank}.json"), "w") as f:
    json.dump(record, f)
