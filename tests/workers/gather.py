"""Distributed worker: the union of every stage's state dict on global rank 0, as a checkpoint and the module after
fit gather it (:func:`lightning_gpipe.lightning.state_dict.gather_union`).

Usage: python gather.py OUT_DIR  (2 processes, started by Lightning's launcher)
At the start of a one-step fit each stage gathers a dict of dense tensors of several dtypes and shapes (a 0-d one, an
empty one, a non-contiguous view), a tensor both stages hold under one name, and values that are not dense tensors.
Global rank 0 writes OUT_DIR/gathered.pt: the union it got and the one the dicts make (the last stage's value of a
shared name).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_gpipe import GPipeStrategy  # noqa: E402
from lightning_gpipe.lightning import state_dict  # noqa: E402


def local_of(rank: int) -> dict:
    """What stage ``rank`` gathers."""
    values = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (rank + 1)
    return {
        "shared.weight": torch.full((3,), float(rank)),
        f"stage{rank}.view": values[:, ::2],
        f"stage{rank}.bf16": values.to(torch.bfloat16),
        f"stage{rank}.int64": torch.arange(5, dtype=torch.int64) - rank,
        f"stage{rank}.bool": torch.tensor([True, False, rank == 1]),
        f"stage{rank}.scalar": torch.tensor(3.5 + rank),
        f"stage{rank}.empty": torch.empty(0, 5),
        f"stage{rank}.options": {"lr": 0.1 * (rank + 1), "betas": (0.9, 0.99)},
        f"stage{rank}.step": 7 + rank,
    }


class Gathers(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        got = state_dict.gather_union(local_of(trainer.global_rank), strategy.pipeline_group, strategy.job)
        if trainer.global_rank == 0:
            torch.save({"got": got, "expected": {**local_of(0), **local_of(1)}}, os.path.join(self.out, "gathered.pt"))
        else:
            assert got is None


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer = L.Trainer(
        strategy=GPipeStrategy(chunks=2, schedule="gpipe"),
        devices=2,
        max_steps=1,
        callbacks=[Gathers(sys.argv[1])],
        **trainer_kwargs(),
    )
    trainer.fit(Net(), DataLoader(data, batch_size=8))
