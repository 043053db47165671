"""Distributed worker: a step fails on one stage; every process must exit, naming the cause.

Usage: python failure.py CASE OUT_DIR --devices K
CASE: "loss" (user code after the backbone raises on the last stage, at the 3rd step),
"validation" (the same in validation_step),
"layer" (a layer of the first stage returns a list), "before_backbone" (a head is called
before the backbone), "balance" (a balance that does not fit, caught before any step).
Each process writes OUT_DIR/rank{r}.txt holding its pid and the time its fit starts, so that the
test can check that none is left and how long they took to exit.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from torch import nn  # noqa: E402

import lightning_gpipe  # noqa: E402
from models import TupleNet, fit  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("case")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
args = parser.parse_args()


class FailingLoss(TupleNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # only the last stage gets past the backbone call
        if batch_idx == 2:
            raise ValueError("boom in the loss")
        return loss


class FailingValidation(TupleNet):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        raise ValueError("boom in validation")


class ReturnsList(nn.Module):
    def forward(self, value):
        return list(value)


class HeadFirst(TupleNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.backbone((self.head(x), x > 0)).sum()


if args.case == "loss":
    module = FailingLoss()
elif args.case == "validation":
    module = FailingValidation()
elif args.case == "layer":
    module = TupleNet()
    module.backbone.insert(1, ReturnsList())
elif args.case == "before_backbone":
    module = HeadFirst()
else:
    module = TupleNet()
with open(os.path.join(args.out, f"rank{os.environ.get('LOCAL_RANK', '0')}.txt"), "w") as f:
    f.write(f"{os.getpid()} {time.time()}")
balance = [1, 1] if args.case == "balance" else None
fit(strategy=lightning_gpipe.GPipeStrategy(chunks=3, balance=balance), devices=args.devices, module=module)
