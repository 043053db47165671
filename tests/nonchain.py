"""Models that are not a plain chain, for tests/unit/test_skip_ties.py, tests/distributed/test_skip_ties.py and
tests/workers/skip_ties.py: a backbone with skip connections (``SkipNet``), one with tied parameters (``TiedNet``),
and the translation example with one table for its embeddings and output projection (:func:`fit_tied_translation`).
"""

import lightning as L
import torch
import torch.nn.functional as F
from models import CLASSES, FEATURES, trainer_kwargs
from tiny_translation import TINY, tiny_datamodule, tiny_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from translation.module import TranslationModule

from lightning_gpipe.engine.skip import Namespace, pop, skippable, stash

VOCAB = 11


@skippable(stash=["skip"])
class Stash(nn.Module):
    """x -> tanh(linear(x)), stashed as "skip" too (so its gradient reaches this layer through the skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        yield stash("skip", h)
        return h


@skippable(pop=["skip"])
class Pop(nn.Module):
    """x -> tanh(linear(x)) + the popped "skip"."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, x):
        skip = yield pop("skip")
        return torch.tanh(self.linear(x)) + skip


def dense() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())


class SkipNet(L.LightningModule):
    """Six layers: layer 0 stashes "skip" and layer 5 pops it (stage 0 -> stage 2 with ``balance=[2, 2, 2]``);
    layers 2 and 3 stash and pop another "skip" in their own namespace, within stage 1."""

    def __init__(self) -> None:
        super().__init__()
        inner = Namespace()
        self.backbone = nn.Sequential(Stash(), dense(), Stash().isolate(inner), Pop().isolate(inner), dense(), Pop())
        self.head = nn.Linear(FEATURES, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def predict_step(self, batch, batch_idx):
        return self.head(self.backbone(batch[0]))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class TiedNet(L.LightningModule):
    """Token ids -> embedding (backbone layer 0) -> ... -> a head whose weight is the embedding's; and one
    ``nn.Linear`` at backbone positions 1 and 5 (stages 0 and 2 with ``balance=[3, 2, 2]``)."""

    def __init__(self) -> None:
        super().__init__()
        embedding, shared = nn.Embedding(VOCAB, FEATURES), nn.Linear(FEATURES, FEATURES)
        self.backbone = nn.Sequential(
            embedding, shared, nn.Tanh(), nn.Linear(FEATURES, FEATURES), nn.Tanh(), shared, nn.Tanh()
        )
        self.head = nn.Linear(FEATURES, VOCAB, bias=False)
        self.head.weight = embedding.weight

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self.head(self.backbone(tokens)), targets)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def skip_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(52, FEATURES, generator=generator)
    return DataLoader(TensorDataset(x, torch.randint(0, CLASSES, (52,), generator=generator)), batch_size=20)


def token_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (52,), generator=generator)
    return DataLoader(TensorDataset(tokens, torch.randint(0, VOCAB, (52,), generator=generator)), batch_size=20)


def fit_nonchain(module_class, strategy="auto", devices=1, callbacks=(), **overrides) -> L.Trainer:
    """Train a freshly seeded ``SkipNet`` or ``TiedNet`` for 6 steps of Adam on its data; returns the Trainer."""
    L.seed_everything(1, verbose=False)
    module = module_class()
    data = skip_loader() if module_class is SkipNet else token_loader()
    trainer = L.Trainer(
        strategy=strategy, devices=devices, max_steps=6, callbacks=list(callbacks), **trainer_kwargs(**overrides)
    )
    trainer.fit(module, data)
    return trainer


TRANSLATION_STEPS = 4
"""Training steps of the tied translation model (the example's tiny Transformer)."""


def fit_tied_translation(strategy="auto", devices=1) -> TranslationModule:
    """Train the translation example's tiny Transformer with tied tables (embedding on the first stage, output
    projection on the last) for :data:`TRANSLATION_STEPS` steps; return it."""
    L.seed_everything(0, verbose=False)
    module = TranslationModule(**TINY, tie_embeddings=True)
    tiny_trainer(strategy, devices, max_steps=TRANSLATION_STEPS).fit(module, tiny_datamodule())
    return module
