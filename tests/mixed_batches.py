"""Batches whose micro-batches mix shapes a stage has seen with shapes it has not (tests/workers/mixed_shapes.py)."""

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


class _Batches(torch.utils.data.IterableDataset):
    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        return iter(
            [(torch.randn(n, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)) for n in SIZES]
        )


def fit(strategy="auto", devices=1) -> L.Trainer:
    """Train a seeded MixedNet one epoch over the batches of :data:`SIZES`."""
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=strategy, devices=devices, **trainer_kwargs(max_epochs=1, use_distributed_sampler=False)
    )
    trainer.fit(MixedNet(), torch.utils.data.DataLoader(_Batches(), batch_size=None))
    return trainer
