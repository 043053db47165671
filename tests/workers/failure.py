"""Distributed worker: a step fails on one stage; every process must exit, naming the cause.

Usage: python failure.py CASE OUT_DIR --devices K
CASE: "loss" (user code after the backbone raises on the last stage, at the 3rd step),
"validation" (the same in validation_step),
"layer" (a layer of the first stage returns a list), "before_backbone" (a head is called
before the backbone), "balance" (a balance that does not fit, caught before any step),
"manual" (manual optimization, refused before any step),
"kill" (the last stage's process is killed with SIGKILL in the middle of step 5, after a checkpoint
was written at step 3 to OUT_DIR/good.ckpt), "resume" (resume from that checkpoint to step 6,
writing rank 0's module state to OUT_DIR/resumed.pt).
Each process writes OUT_DIR/rank{r}.txt holding its pid and the time its fit starts, so that the
test can check that none is left and how long they took to exit.
"""

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
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


class KilledMidStep(TupleNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # the last stage, while stage 0 waits for gradients
        if self.trainer.global_step == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss


class Manual(TupleNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class ReturnsList(nn.Module):
    def forward(self, value):
        return list(value)


class HeadFirst(TupleNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.backbone((self.head(x), x > 0)).sum()


L.seed_everything(1, verbose=False)  # as `fit` does before it creates a module itself
if args.case == "loss":
    module = FailingLoss()
elif args.case == "validation":
    module = FailingValidation()
elif args.case == "layer":
    module = TupleNet()
    module.backbone.insert(1, ReturnsList())
elif args.case == "before_backbone":
    module = HeadFirst()
elif args.case == "manual":
    module = Manual()
elif args.case == "kill":
    module = KilledMidStep()
else:
    module = TupleNet()
with open(os.path.join(args.out, f"rank{os.environ.get('LOCAL_RANK', '0')}.txt"), "w") as f:
    f.write(f"{os.getpid()} {time.time()}")
balance = [1, 1] if args.case == "balance" else None
strategy = lightning_gpipe.GPipeStrategy(chunks=3, balance=balance)
checkpoints = ModelCheckpoint(dirpath=args.out, filename="good", every_n_train_steps=3, save_top_k=-1)
resume = os.path.join(args.out, "good.ckpt") if args.case == "resume" else None
module = fit(
    strategy=strategy, devices=args.devices, module=module, enable_checkpointing=True, callbacks=[checkpoints],
    ckpt_path=resume,
)  # fmt: skip
if args.case == "resume" and strategy.global_rank == 0:
    torch.save(module.state_dict(), os.path.join(args.out, "resumed.pt"))
