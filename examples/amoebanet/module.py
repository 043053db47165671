"""LightningModule training AmoebaNet-D for image classification.

Written for the GPipe strategy (Huang et al. 2019, arXiv:1811.06965): the
network is the single ``nn.Sequential`` attribute ``backbone``, which the
strategy splits into pipeline stages. Code before the backbone call only
unpacks data; the loss and metrics only read the backbone's output.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import Tensor
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from amoebanet.model import amoebanetd


def one_cycle(trainer: Trainer, warmup_fraction: float) -> Callable[[int], float]:
    """The learning-rate factor of step s for ``LambdaLR``: one cycle (Smith and Topin 2019, "Super-convergence", as
    torch's ``OneCycleLR`` with cosine annealing) over the steps of the run, ``trainer.estimated_stepping_batches``
    (``max_steps``, or the steps of ``max_epochs``), read at every step, so that a run whose last step moves
    (:class:`~time_budget.TimeBudget`) ends its cycle there.

    Args:
        trainer: the Trainer whose run the cycle spans.
        warmup_fraction: share of the steps spent rising, in (0, 1).

    Returns:
        ``factor(step)``: from 1/25 at step 0 up to 1 at ``warmup_fraction * max_steps`` (a half cosine), then down to
        1/25e4 at the last step (a half cosine), and 1/25e4 after it.
    """

    def factor(step: int) -> float:
        progress = min(step / max(trainer.estimated_stepping_batches, 1), 1.0)
        if progress < warmup_fraction:
            low, high, share = 1 / 25, 1.0, progress / warmup_fraction
        else:
            low, high, share = 1.0, 1 / 25e4, (progress - warmup_fraction) / (1 - warmup_fraction)
        return high + (low - high) * (1 + math.cos(math.pi * share)) / 2

    return factor


class AmoebaNetClassifier(LightningModule):
    """Cross-entropy classification with an AmoebaNet-D (L, D) backbone and SGD.

    Args:
        num_classes: number of classes. Default 10 (CIFAR-10).
        num_layers: L, normal cells in total (a multiple of 3). Default 6.
        num_filters: D, filters of the first stack. Default 16.
        image_size: input side; 128 and above use the ImageNet stem. Default 32.
        lr: SGD learning rate; with ``one_cycle``, the peak. Default 0.05.
        momentum: SGD (Nesterov) momentum. Default 0.9.
        weight_decay: SGD weight decay. Default 5e-4.
        label_smoothing: label smoothing of the training loss (Szegedy et al. 2016). Default 0.
        one_cycle: schedule the learning rate in one cycle (see :func:`one_cycle`): up from ``lr / 25`` to ``lr`` over
            the first ``warmup_fraction`` of the run's steps (read at every step), then cosine
            annealing down to ``lr / 25e4``, stepped every step. Default False: a constant ``lr``.
        warmup_fraction: share of the steps spent rising with ``one_cycle``. Default 0.25.
        channels_last: keep the backbone's weights and the input images in ``torch.channels_last`` memory format.
            Default False.
        flip_test: validate on each image and its mirror image, averaging their logits (test-time augmentation: one
            backbone call on the batch and its flip, twice the rows). Default False.

    Batches are ``(images (N, 3, S, S) float, labels (N,) long)``.
    """

    def __init__(
        self,
        num_classes: int = 10,
        num_layers: int = 6,
        num_filters: int = 16,
        image_size: int = 32,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        label_smoothing: float = 0.0,
        one_cycle: bool = False,
        warmup_fraction: float = 0.25,
        channels_last: bool = False,
        flip_test: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = amoebanetd(num_classes, num_layers, num_filters, image_size)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.backbone.to(memory_format=self.memory_format)
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.val_loss = MeanMetric()  # a metric, not a tensor: exact over several pipeline replicas, and no warning

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Run the backbone on the images; log and return the (label-smoothed) cross-entropy loss."""
        images, labels = batch
        logits = self.backbone(images.contiguous(memory_format=self.memory_format))
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Log the validation loss and accuracy of one batch (of the logits averaged with the mirror images' with
        ``flip_test``)."""
        images, labels = batch
        if self.hparams.flip_test:
            images = torch.cat([images, images.flip(-1)])
        logits = self.backbone(images.contiguous(memory_format=self.memory_format))
        if self.hparams.flip_test:
            logits = logits.view(2, len(labels), -1).mean(0)
        self.val_acc(logits, labels)
        self.val_loss(F.cross_entropy(logits, labels), weight=len(labels))
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        """SGD with Nesterov momentum over the parameters this process holds; :func:`one_cycle` with ``one_cycle``."""
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=True
        )
        if not hp.one_cycle:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, one_cycle(self.trainer, hp.warmup_fraction))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
