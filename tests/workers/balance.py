"""Distributed worker: GPipeStrategy(balance="time") profiles a skewed backbone on rank 0 and every stage splits alike.

Usage: python balance.py OUT_DIR --devices K  (run with Lightning's launcher)
Writes OUT_DIR/rank{r}.json: the strategy's layer costs, the names of the stage's local layers, the
time split the costs give, the micro-batch rows the profile ran at, and (rank 0) whether training
with the profiled balance gives the same weights as training with that balance given as a list.
The profiler reads :class:`Work`'s clock instead of the CPU's, so that the costs, and the split, are the work's.
"""

import argparse
import dataclasses
import json
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import FEATURES, Block, Fork, Merge, TupleNet, fit  # noqa: E402
from torch import nn  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.planning.balance import profile  # noqa: E402


class Work:
    """The profiler's clock here: seconds that pass only as a :class:`SlowBlock` works, one per Block it applies (the
    others cost nothing), whatever else the machine runs."""

    seconds = 0.0


class SlowBlock(Block):
    """A Block applied ``times`` times, then dropout: as many parameters as a Block, ``times`` as much work."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def forward(self, value):
        for _ in range(self.times):
            value = super().forward(value)
            Work.seconds += 1.0
        h, skip, mask = value
        return F.dropout(h, 0.1, self.training), skip, mask


class SkewedNet(TupleNet):
    """TupleNet whose second and third layers are slow: the parameter split [4, 4] is far from the time split."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(Fork(), SlowBlock(30), SlowBlock(30), *[Block() for _ in range(4)], Merge())


class LocalLayers(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.names = list(pl_module.backbone._modules)


def train(balance, devices: int):
    L.seed_everything(1, verbose=False)
    strategy = lightning_gpipe.GPipeStrategy(chunks=4, balance=balance)
    local = LocalLayers()
    module = fit(strategy=strategy, devices=devices, module=SkewedNet(), max_steps=2, callbacks=[local])
    return strategy, local.names, module.state_dict()


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

with mock.patch.object(profile, "_clock", lambda device: lambda: Work.seconds):
    strategy, names, profiled_state = train("time", args.devices)
expected = lightning_gpipe.balance_by("time", strategy.layer_costs, args.devices)
_, _, given_state = train(expected, args.devices)
record = {
    "costs": [dataclasses.asdict(cost) for cost in strategy.layer_costs],
    "local": names,
    "expected": expected,
    "micro_batch_rows": strategy.layer_costs[-1].output_bytes // (FEATURES * 4),
    "same_as_given_split": strategy.global_rank == 0  # the whole model is on rank 0 after fit
    and all(torch.equal(profiled_state[k], given_state[k]) for k in given_state),
}
with open(os.path.join(args.out, f"rank{strategy.global_rank}.json"), "w") as f:
    json.dump(record, f)
