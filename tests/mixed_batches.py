"""Batches whose micro-batches mix shapes a stage has seen with shapes it has not (tests/workers/mixed_shapes.py): of
rows (:class:`MixedNet`), and of ``channels_last`` images (:class:`MixedConvNet`, whose activations cross the stage
boundary in that layout)."""

import lightning as L
import torch
import torch.nn.functional as F
from models import trainer_kwargs
from torch import nn

SIZES = (16, 20, 16, 18, 22, 16)
"""Rows per batch, in 4 micro-batches: 20 rows makes micro-batches of 5 (new: sent after their signature), 22 makes
6, 6, 5, 5: two new ones, then two whose shape the step message gives."""


class MixedNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MixedConvNet(L.LightningModule):
    """Two convolutions in ``channels_last`` (weights and images), then a linear head: the activation between its
    backbone's halves is ``channels_last``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh()
        )
        self.head = nn.Linear(4 * 5 * 5, 3)
        self.backbone.to(memory_format=torch.channels_last)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x.to(memory_format=torch.channels_last)).flatten(1)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Batches(torch.utils.data.IterableDataset):
    def __init__(self, images: bool = False) -> None:
        self.shape = (3, 5, 5) if images else (8,)

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        return iter(
            [
                (torch.randn(n, *self.shape, generator=generator), torch.randint(0, 3, (n,), generator=generator))
                for n in SIZES
            ]
        )


def fit(strategy="auto", devices=1, images: bool = False) -> L.Trainer:
    """Train a seeded MixedNet (``images``: a MixedConvNet) one epoch over the batches of :data:`SIZES`."""
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=strategy, devices=devices, **trainer_kwargs(max_epochs=1, use_distributed_sampler=False)
    )
    module = MixedConvNet() if images else MixedNet()
    trainer.fit(module, torch.utils.data.DataLoader(_Batches(images), batch_size=None))
    return trainer
