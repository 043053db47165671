"""Distributed worker: a convolutional net with batch norm on both stages, trained with deferred batch norm.

Usage: python batchnorm.py OUT_DIR  (2 stages, started by Lightning's launcher)
Writes OUT_DIR/{config}.pt (rank 0's module state dict after fit) and OUT_DIR/{config}_types_rank{r}.txt
(the classes of the backbone's batch norm layers in each rank's module after fit) for every entry of
:data:`CONFIGS`. The test compares them with single-device :func:`fit`.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from models import CLASSES, FEATURES, loader, trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402

import lightning_gpipe  # noqa: E402

# name: (chunks, checkpoint, learning rate). With one micro-batch the whole run equals single-device
# training. With several, each micro-batch is normalised with its own statistics, so parameters drift
# apart from single-device training (a learning rate of 0 keeps them fixed), and a batch norm whose input
# went through an earlier batch norm sees other activations. Mini-batches have 20, 20 and 12 rows.
CONFIGS = {
    "M1_always": (1, "always", 0.1),
    "M4_except_last": (4, "except_last", 0.0),
    "M3_always": (3, "always", 0.0),
}
DOWNSTREAM = "backbone.4."  # the batch norm after both branches: equal running statistics with one micro-batch only
SIDE = 4  # FEATURES = SIDE * SIDE: each row is a one-channel 4x4 image


def conv_block(momentum=0.1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU())


class Fork(nn.Module):
    def forward(self, x):
        return x, x


class Branch(nn.Module):
    """Applies ``block`` to item ``index`` of a pair."""

    def __init__(self, block: nn.Module, index: int) -> None:
        super().__init__()
        self.block, self.index = block, index

    def forward(self, pair):
        items = list(pair)
        items[self.index] = self.block(items[self.index])
        return tuple(items)


class Join(nn.Module):
    def forward(self, pair):
        return (pair[0] + pair[1]).flatten(1)


class ConvNet(L.LightningModule):
    """Two conv + BatchNorm2d branches of the input image (on stage 0 and stage 1), a BatchNorm1d, a head.

    Each branch's batch norm sees activations that depend on the data only (no other batch norm before
    it), so its running statistics can equal single-device training's with any number of micro-batches.
    """

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Sequential(
            Fork(), Branch(conv_block(), 0), Branch(conv_block(momentum=None), 1), Join(), nn.BatchNorm1d(4 * FEATURES)
        )
        self.head = nn.Linear(4 * FEATURES, CLASSES)

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x.view(-1, 1, SIDE, SIDE))), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def fit(lr: float, strategy="auto", devices: int = 1) -> L.LightningModule:
    """Train a freshly seeded ConvNet for 6 steps (two epochs of :func:`models.loader`) and return it."""
    L.seed_everything(1, verbose=False)
    module = ConvNet(lr)
    trainer = L.Trainer(strategy=strategy, devices=devices, max_steps=6, **trainer_kwargs())
    trainer.fit(module, loader(), loader(seed=1))
    return module


if __name__ == "__main__":
    out = sys.argv[1]
    for name, (chunks, checkpoint, lr) in CONFIGS.items():
        strategy = lightning_gpipe.GPipeStrategy(
            balance=[2, 3], chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=True
        )
        module = fit(lr, strategy, devices=2)
        rank = strategy.global_rank
        types = [type(m).__name__ for m in module.backbone.modules() if isinstance(m, _BatchNorm)]
        with open(os.path.join(out, f"{name}_types_rank{rank}.txt"), "w") as f:
            f.write(" ".join(types))
        if rank == 0:
            torch.save(module.state_dict(), os.path.join(out, f"{name}.pt"))
