"""Distributed worker: every stage reads the same batch (shuffled loader, random draws on the data path and on one
stage), a loader that diverges fails loudly, and rank 0's callbacks see the step's real loss.

Usage: python agreement.py OUT_DIR --devices N [--pipeline K]
Runs on N processes as pipelines of K stages (K = N by default; N = 4, K = 2 is pp 2 x dp 2):
- "probe": a ``DataLoader(shuffle=True)`` with random augmentation in its worker process,
  ``seed_everything(workers=True)``, random data preparation before the backbone call, stages that draw different
  amounts of random numbers in their forwards (dropout and ``torch.rand``), 3 epochs. Every row carries its own
  index as feature 0 through the backbone, and its label is that index: the last stage of each replica writes
  OUT_DIR/probe_rank{r}.json with, per epoch, the labels it read in order and the number of rows whose backbone
  output came from another row; every rank writes the first random numbers its stage layers drew
  (OUT_DIR/draws_rank{r}.json) and the loss its rank-0 callback saw per step next to the loss the last stage
  computed (OUT_DIR/losses_rank{r}.json).
- "mismatch": the same, but every process keeps its own ``RandomSampler`` seeded by its rank
  (``use_distributed_sampler=False``); every rank writes the error that ended its fit to
  OUT_DIR/mismatch_rank{r}.txt.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, RandomSampler  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
parser.add_argument("--pipeline", type=int, default=None)
args = parser.parse_args()
ROWS, WIDTH, BATCH, EPOCHS = 64, 8, 16, 3


class Rows(Dataset):
    """Row i: features (i, random augmentation drawn from torch's global generator...), label i."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int):
        return torch.cat([torch.tensor([float(i)]), torch.rand(WIDTH - 1)]), i


class Carry(nn.Module):
    """Keeps feature 0 (the row index) and transforms the others; ``draws`` records its first random numbers."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.linear, self.noisy, self.draws = nn.Linear(WIDTH - 1, WIDTH - 1), noisy, []
        self.dropout = nn.Dropout(0.5)

    def forward(self, x):
        rest = torch.tanh(self.linear(x[:, 1:]))
        if self.noisy:
            draw = torch.rand(4)
            self.draws = self.draws or draw.tolist()
            rest = self.dropout(rest) + 0.01 * draw.sum()
        return torch.cat([x[:, :1], rest], dim=1)


class RowNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(Carry(noisy=True), Carry(noisy=True), Carry(noisy=True), Carry(noisy=False))
        self.head = nn.Linear(WIDTH, ROWS)
        self.read: dict[int, list[int]] = {}
        self.foreign: dict[int, int] = {}
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = torch.cat([x[:, :1], x[:, 1:] + 0.01 * torch.rand_like(x[:, 1:])], dim=1)  # data preparation, random
        out = self.backbone(x)
        epoch = self.current_epoch
        self.read.setdefault(epoch, []).extend(y.tolist())
        self.foreign[epoch] = self.foreign.get(epoch, 0) + int((out[:, 0].round().long() != y).sum())
        loss = F.cross_entropy(self.head(out), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SeenLosses(Callback):
    """What a callback sees of each step's output."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.seen.append(float(outputs["loss"]))


def run(case: str) -> None:
    L.seed_everything(7, workers=True, verbose=False)
    module, seen = RowNet(), SeenLosses()
    mismatch = case == "mismatch"
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    sampler = RandomSampler(range(ROWS), generator=torch.Generator().manual_seed(rank)) if mismatch else None
    loader = DataLoader(Rows(), BATCH, shuffle=not mismatch, sampler=sampler, num_workers=0 if mismatch else 1)
    strategy = lightning_gpipe.GPipeStrategy(chunks=2, pipeline_parallel_size=args.pipeline or "auto")
    kwargs = trainer_kwargs(max_epochs=EPOCHS, callbacks=[seen], use_distributed_sampler=not mismatch)
    trainer = L.Trainer(strategy=strategy, devices=args.devices, **kwargs)
    try:
        trainer.fit(module, loader)
    except lightning_gpipe.BatchMismatchError as error:
        with open(os.path.join(args.out, f"mismatch_rank{trainer.global_rank}.txt"), "w") as f:
            f.write(str(error))
        return
    rank = trainer.global_rank
    draws = [layer.draws for layer in module.backbone if isinstance(layer, Carry) and layer.draws]
    with open(os.path.join(args.out, f"draws_rank{rank}.json"), "w") as f:
        json.dump(draws, f)
    with open(os.path.join(args.out, f"losses_rank{rank}.json"), "w") as f:
        json.dump({"seen": seen.seen, "computed": module.losses}, f)
    if module.read:
        with open(os.path.join(args.out, f"probe_rank{rank}.json"), "w") as f:
            json.dump({"read": module.read, "foreign": module.foreign}, f)


if __name__ == "__main__":
    for case in ("probe", "mismatch"):
        out = os.path.join(args.out, case)
        os.makedirs(out, exist_ok=True)
        args.out, base = out, args.out
        run(case)
        args.out = base
