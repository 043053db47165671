"""Distributed worker: runs of one script on one module whose split changes from run to run.

Usage: python split_changes.py OUT_DIR  (2 processes, started by Lightning's launcher)
For a module created whole and one created on the meta device (``configure_model``): fit 4 steps split [3, 1], then
predict split [1, 3] (each stage now holds layers the other trained) and split [3, 1] again. Global rank 0 writes
OUT_DIR/NAME.pt: both predictions and, for the whole module, its layers' unsaved buffers after fit and its trained
module's own output on the same rows.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import copy  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_gpipe import GPipeStrategy  # noqa: E402


class ScaledLinear(nn.Linear):
    """A Linear(8, 8) whose output is multiplied by a buffer no state dict holds (``persistent=False``, as a rotary
    embedding's frequencies), all ones after ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.register_buffer("scale", torch.ones(8), persistent=False)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scale"):
            self.scale.fill_(1.0)

    def forward(self, x):
        return super().forward(x) * self.scale


class Net(L.LightningModule):
    """Four scaled Linear(8, 8) layers and a head; with ``meta``, created in ``configure_model`` (on the meta device
    under the strategy), else whole, with each layer's scale set to ``0.5 + 0.25 * index`` (not what a reset
    gives)."""

    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        self.meta = meta
        if not meta:
            self.configure_model()
            for index, layer in enumerate(self.backbone):
                layer.scale.fill_(0.5 + 0.25 * index)

    def configure_model(self) -> None:
        if not hasattr(self, "backbone"):
            self.backbone = nn.Sequential(*[ScaledLinear() for _ in range(4)])
            self.head = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def predict_step(self, batch, batch_idx):
        return self.head(self.backbone(batch[0]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def run(name: str, out: str) -> None:
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    rows = DataLoader(TensorDataset(data.tensors[0][:8]), batch_size=8)
    module = Net(meta=name == "meta")
    strategy = GPipeStrategy(balance=[3, 1], chunks=2)
    L.Trainer(strategy=strategy, devices=2, max_steps=4, **trainer_kwargs()).fit(module, DataLoader(data, batch_size=8))
    own = scales = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0 and name == "whole":
        scales = [layer.scale.clone() for layer in module.backbone]
        trained = copy.deepcopy(module).eval()
        with torch.no_grad():
            own = trained.head(trained.backbone(data.tensors[0][:8]))
    predicted = {}
    for balance in ([1, 3], [3, 1]):
        trainer = L.Trainer(strategy=GPipeStrategy(balance=balance, chunks=2), devices=2, **trainer_kwargs())
        predicted[str(balance)] = trainer.predict(module, rows)[0]
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save({"predicted": predicted, "own": own, "scales": scales}, os.path.join(out, f"{name}.pt"))


if __name__ == "__main__":
    for each in ("whole", "meta"):
        run(each, sys.argv[1])
