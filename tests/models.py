"""Small LightningModules and data shared by the in-process tests and the distributed workers."""

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 16, 3


class Fork(nn.Module):
    """(x, mask) -> (h, x, mask): starts a tuple activation that carries a bool tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, value):
        x, mask = value
        return torch.tanh(self.linear(x)), x, mask


class Block(nn.Module):
    """(h, skip, mask) -> (h', skip, mask) with a masked residual update."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)

    def forward(self, value):
        h, skip, mask = value
        return h + torch.tanh(self.linear(h)) * mask, skip, mask


class Merge(nn.Module):
    """(h, skip, mask) -> h + skip: back to a single tensor."""

    def forward(self, value):
        h, skip, _ = value
        return h + skip


class TupleNet(L.LightningModule):
    """A backbone whose activations between layers are tuples (float, float, bool), then a head.

    ``training_step`` prepares the mask from the batch (no parameters), calls the backbone once, and
    computes the loss with a head that lives on the last stage only.
    """

    def __init__(self, blocks: int = 6, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Sequential(Fork(), *[Block() for _ in range(blocks)], Merge())
        self.head = nn.Linear(FEATURES, CLASSES)

    def _loss(self, batch):
        x, y = batch
        mask = x > -1.0
        return F.cross_entropy(self.head(self.backbone((x, mask))), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.head(self.backbone((x, x > -1.0)))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class LazyNet(TupleNet):
    """TupleNet whose layers are created in ``configure_model`` (on the meta device under GPipeStrategy)."""

    def __init__(self, blocks: int = 6, lr: float = 0.1) -> None:
        L.LightningModule.__init__(self)
        self.blocks, self.lr = blocks, lr
        self.backbone = None

    def configure_model(self):
        if self.backbone is None:
            self.backbone = nn.Sequential(Fork(), *[Block() for _ in range(self.blocks)], Merge())
            self.head = nn.Linear(FEATURES, CLASSES)


def loader(rows: int = 52, batch_size: int = 20, seed: int = 0) -> DataLoader:
    """Random classification data; 52 rows in batches of 20 give batches of 20, 20 and 12 rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def trainer_kwargs(**overrides) -> dict:
    """Quiet Trainer settings for tests."""
    kwargs = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


def fit(strategy="auto", devices=1, max_steps=6, seed=1, module=None, **overrides) -> L.LightningModule:
    """Train a freshly seeded TupleNet (or ``module``) on :func:`loader` data and return it."""
    return fit_trainer(strategy, devices, max_steps, seed, module, **overrides).lightning_module


def fit_trainer(strategy="auto", devices=1, max_steps=6, seed=1, module=None, ckpt_path=None, **overrides) -> L.Trainer:
    """Like :func:`fit`, returning the Trainer; ``ckpt_path`` resumes from a checkpoint."""
    L.seed_everything(seed, verbose=False)
    module = module or TupleNet()
    trainer = L.Trainer(strategy=strategy, devices=devices, max_steps=max_steps, **trainer_kwargs(**overrides))
    trainer.fit(module, loader(), loader(seed=1), ckpt_path=ckpt_path)
    return trainer


class LoggedNet(TupleNet):
    """TupleNet that logs a torchmetrics metric per step and an epoch-end value, like a typical user."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.train_acc = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(CLASSES, average="micro")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.backbone((x, x > -1.0)))
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.head(self.backbone((x, x > -1.0)))
        self.val_acc.update(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y))

    def on_validation_epoch_end(self):
        self.log("val_acc", self.val_acc.compute())
        self.val_acc.reset()


def logged_fit(root: str, strategy="auto", devices=1) -> "L.Trainer":
    """Train LoggedNet for 3 epochs with a CSV logger, ModelCheckpoint and EarlyStopping on ``val_loss``."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(1, verbose=False)
    module = LoggedNet()
    trainer = L.Trainer(
        strategy=strategy,
        devices=devices,
        max_epochs=3,
        log_every_n_steps=1,
        **trainer_kwargs(
            logger=CSVLogger(root, name="logs", version=0),
            enable_checkpointing=True,
            callbacks=[
                ModelCheckpoint(dirpath=f"{root}/checkpoints", monitor="val_loss", save_top_k=1),
                EarlyStopping(monitor="val_loss", patience=10),
            ],
        ),
    )
    trainer.fit(module, loader(), loader(seed=1))
    return trainer


GLOBAL_BATCH = 40
"""Rows of one global batch in the data-parallel tests: each of D replicas reads ``GLOBAL_BATCH // D`` of them."""


class SyncNet(TupleNet):
    """TupleNet that logs its training loss with ``sync_dist=True`` (averaged over data-parallel replicas)."""

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss


class LossRecorder(L.Callback):
    """Keeps ``trainer.callback_metrics["train_loss"]`` after every training batch, as global rank 0 sees it."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, *_) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def ddp_order_loader(batch_size: int = GLOBAL_BATCH) -> DataLoader:
    """:func:`loader`'s data in the order Lightning's ``DistributedSampler`` gives D data-parallel replicas together
    (shuffled with the seed of ``seed_everything``, reshuffled every epoch): the single-device reference of a
    data-parallel run whose replicas read ``batch_size // D`` rows per batch."""
    import os

    from torch.utils.data.distributed import DistributedSampler

    dataset, seed = loader().dataset, int(os.environ.get("PL_GLOBAL_SEED", 0))
    return DataLoader(dataset, batch_size, sampler=DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed))
