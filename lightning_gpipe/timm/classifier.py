"""A LightningModule that fine-tunes one timm model for image classification through ``GPipeStrategy``."""

from __future__ import annotations

from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gpipe.timm.sequential import to_sequential


class ImageClassifier(pl.LightningModule):
    """Cross-entropy image classification with a timm model as the backbone (:func:`to_sequential`'s).

    The timm model is kept outside the module's submodules (its modules are the backbone's), so each stage holds
    only its own layers. Batches are ``(images (N, C, H, W) float, labels (N,) long)``, as the AmoebaNet example's
    CIFAR-10 data module gives them; the module logs ``train_loss``, ``train_acc``, ``val_loss`` and ``val_acc``.

    Args:
        model: a timm model name (``"resnet18"``, built with ``timm.create_model``) or a timm model.
        num_classes: the classes; with a name, the model is built with that many (default 10); with a model, its
            classifier is replaced (``reset_classifier``) when it has another number, kept when ``None``.
        pretrained: load timm's pretrained weights for a name (downloads them). Default ``False``.
        model_kwargs: more arguments of ``timm.create_model`` (``{"drop_path_rate": 0.1, "img_size": 32}``).
        optimizer: ``"sgd"`` (default: Nesterov momentum) or ``"adamw"``.
        lr: the learning rate. Default 0.05.
        momentum: SGD's momentum. Default 0.9.
        weight_decay: the weight decay. Default 5e-4.
        betas: AdamW's betas. Default (0.9, 0.999).
        label_smoothing: label smoothing of the training loss. Default 0.
        self_check: prove the cut on the model before training (default; see :mod:`lightning_gpipe.timm.selfcheck`).

    Attributes:
        backbone: the ``nn.Sequential`` of :func:`to_sequential`.
        timm_model: the timm model (not a submodule).

    Raises:
        ValueError: for another ``optimizer``.
        UnsupportedModelError: for a model of no supported family.
        SelfCheckError: if the cut does not compute the model's forward.
    """

    def __init__(
        self,
        model: str | nn.Module = "resnet18",
        num_classes: int | None = 10,
        pretrained: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        optimizer: str = "sgd",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        label_smoothing: float = 0.0,
        self_check: bool = True,
    ) -> None:
        super().__init__()
        if optimizer not in ("sgd", "adamw"):
            raise ValueError(f"optimizer={optimizer!r}: choose 'sgd' or 'adamw'.")
        self.save_hyperparameters(ignore=["model"] if isinstance(model, nn.Module) else None)
        self.optimizer_name, self.lr, self.momentum, self.weight_decay = optimizer, lr, momentum, weight_decay
        self.betas, self.label_smoothing = betas, label_smoothing
        if isinstance(model, str):
            import timm  # the package's __init__ checked that it imports

            arguments: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
            model = timm.create_model(model, pretrained=pretrained, **arguments, **(model_kwargs or {}))
        elif num_classes is not None and num_classes != model.num_classes:
            cast(Any, model).reset_classifier(num_classes)  # every timm model has it
        self.__dict__["timm_model"] = model
        self.backbone = to_sequential(model, check=self_check)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """The backbone on the images; log and return the (label-smoothed) cross-entropy."""
        images, labels = batch
        logits = self.backbone(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(labels))
        self.log("train_acc", _accuracy(logits, labels), batch_size=len(labels))
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        """Log the cross-entropy and accuracy of one batch (averaged over the epoch's images)."""
        images, labels = batch
        logits = self.backbone(images)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, batch_size=len(labels))
        self.log("val_acc", _accuracy(logits, labels), prog_bar=True, batch_size=len(labels))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD with Nesterov momentum, or AdamW, over the parameters this process holds."""
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            self.parameters(),
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            nesterov=self.momentum > 0,
        )


def _accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    return (logits.argmax(-1) == labels).float().mean()
