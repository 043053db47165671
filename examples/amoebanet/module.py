"""LightningModule training AmoebaNet-D for image classification.

Written for the GPipe strategy (Huang et al. 2019, arXiv:1811.06965): the
network is the single ``nn.Sequential`` attribute ``backbone``, which the
strategy splits into pipeline stages. Code before the backbone call only
unpacks data; the loss and metrics only read the backbone's output.
"""

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from amoebanet.model import amoebanetd


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
        one_cycle: schedule the learning rate with torch's ``OneCycleLR`` (Smith and Topin 2019, "Super-convergence"):
            up from ``lr / 25`` to ``lr`` over the first ``warmup_fraction`` of the run's steps
            (``Trainer.estimated_stepping_batches``, so set ``max_steps`` or ``max_epochs``), then cosine annealing
            down to ``lr / 25e4``, stepped every step. Default False: a constant ``lr``.
        warmup_fraction: share of the steps spent rising with ``one_cycle``. Default 0.25.
        channels_last: keep the backbone's weights and the input images in ``torch.channels_last`` memory format.
            Default False.

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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.backbone = amoebanetd(num_classes, num_layers, num_filters, image_size)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.backbone.to(memory_format=self.memory_format)
        self.train_acc = MulticlassAccuracy(num_classes)
        self.val_acc = MulticlassAccuracy(num_classes)

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
        """Log the validation loss and accuracy of one batch."""
        images, labels = batch
        logits = self.backbone(images.contiguous(memory_format=self.memory_format))
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer | dict:
        """SGD with Nesterov momentum over the parameters this process holds; ``OneCycleLR`` with ``one_cycle``."""
        hp = self.hparams
        optimizer = torch.optim.SGD(
            self.parameters(), lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay, nesterov=True
        )
        if not hp.one_cycle:
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=hp.lr, total_steps=int(self.trainer.estimated_stepping_batches),
            pct_start=hp.warmup_fraction, cycle_momentum=False,
        )  # fmt: skip
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
