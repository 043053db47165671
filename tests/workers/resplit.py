"""Distributed worker: ``balance="time"`` checked against injected stage times and re-split in place.

Usage: python resplit.py OUT_DIR --devices 2  (run with Lightning's launcher)
Trains AdamWNet (8 backbone layers, batches of 26 rows, 2 micro-batches, 6 AdamW steps) with a profile that says the
layers cost alike (so ``balance="time"`` splits [4, 4]) and a time source that says layer 1 costs 8 times the others
(the stages' "measured" busy times; no clock is read), checked after steps 2 and 3: under ``schedule="gpipe"``
(``time_gpipe``) and ``"1f1b"`` (``time_1f1b``), and with ``balance=[4, 4]`` given (``given``).
Writes OUT_DIR/{run}.pt on rank 0 (the state and every step's loss, after fit) and OUT_DIR/{run}_rank{r}.pt (the
stage's layers before and after, the check's record, and its optimizer's state by parameter name at the end of
training); ``time_gpipe`` also writes OUT_DIR/time_gpipe/pipeline_balance.json (the PipelineBalance report).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from models import LossRecorder  # noqa: E402
from rowwise import fit_batches  # noqa: E402
from sharded import AdamWNet  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.lightning.resplit import Resplit  # noqa: E402

WEIGHTS = [1, 8, 1, 1, 1, 1, 1, 1]
"""Each backbone layer's injected busy milliseconds per step: layer 1 is the slow one the profile does not see."""


def busy(run, spans) -> float:
    """The injected time source: the stage's layers' :data:`WEIGHTS`, whatever the clock says."""
    return 1e-3 * sum(WEIGHTS[int(name)] for name, _ in run.partition.named_children())


class Stage(L.Callback):
    """The stage's layers at the start and end of training, and its optimizer's state by parameter name at the end."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.before = [name for name, _ in pl_module.backbone.named_children()]

    def on_train_end(self, trainer, pl_module) -> None:
        self.after = [name for name, _ in pl_module.backbone.named_children()]
        names = {id(p): name for name, p in pl_module.named_parameters()}
        optimizer = trainer.optimizers[0]
        self.state = {
            names[id(p)]: dict(optimizer.state[p]) for group in optimizer.param_groups for p in group["params"]
        }


parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()

profile = [lightning_gpipe.LayerCost(forward=1e-3, backward=2e-3)] * len(WEIGHTS)  # every layer alike
runs = {"time_gpipe": ("time", "gpipe"), "time_1f1b": ("time", "1f1b"), "given": ([4, 4], "gpipe")}
for run, (balance, schedule) in runs.items():
    strategy = lightning_gpipe.GPipeStrategy(chunks=2, balance=balance, schedule=schedule)
    strategy.layer_costs = list(profile)  # reused, not profiled: the split is decided by these costs alone
    strategy.resplit = Resplit(warmup=1, steps=2, busy=busy)
    stage, recorder = Stage(), LossRecorder()
    report = [lightning_gpipe.PipelineBalance(warmup=0, steps=1)] if run == "time_gpipe" else []
    root = os.path.join(args.out, run)
    trainer = fit_batches(
        strategy,
        args.devices,
        batch_size=26,
        module=AdamWNet,
        callbacks=[stage, recorder, *report],
        default_root_dir=root,
    )
    rank = trainer.global_rank
    record = {"before": stage.before, "after": stage.after, "record": strategy.resplit.record, "state": stage.state}
    torch.save(record, os.path.join(args.out, f"{run}_rank{rank}.pt"))
    if rank == 0:
        result = {"state": trainer.lightning_module.state_dict(), "losses": recorder.losses}
        torch.save(result, os.path.join(args.out, f"{run}.pt"))
