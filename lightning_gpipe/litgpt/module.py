""":class:`CausalLM`: a LightningModule that trains litgpt's ``GPT`` (any config) as a pipelined backbone.

It proves the cut on a miniature of the config in ``__init__`` (before any stage process starts) and builds the model
in ``configure_model`` on the meta device: under ``GPipeStrategy`` (whose ``model_sharded_context`` is the meta
device) each stage then allocates only its own layers and reads only their tensors from a ``lit_model.pth``
(:class:`~lightning_gpipe.litgpt.checkpoint.LitCheckpoint`); under any other strategy, or in
``load_from_checkpoint``, the whole model is materialised at once the same way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_gpipe.engine import materialize
from lightning_gpipe.litgpt.adapter import to_sequential
from lightning_gpipe.litgpt.checkpoint import LitCheckpoint
from lightning_gpipe.litgpt.generate import greedy_generate
from lightning_gpipe.litgpt.selfcheck import check_cut

try:
    from litgpt.config import Config
    from litgpt.model import GPT
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError('lightning_gpipe.litgpt needs litgpt: pip install "lightning-gpipe[litgpt]"') from error


def lit_config(model: str | dict | Config | GPT | None, checkpoint: str | os.PathLike | None) -> Config:
    """The ``litgpt.Config`` of ``model``: a config name (``Config.from_name``), a dict of ``Config`` fields, a
    ``Config``, a ``GPT``'s config; or with ``model=None`` the config of the checkpoint directory ``checkpoint``
    (``Config.from_checkpoint``: its ``model_config.yaml``).

    Raises:
        ValueError: with neither a model nor a checkpoint directory.
    """
    if isinstance(model, GPT):
        return model.config
    if isinstance(model, Config):
        return model
    if isinstance(model, str):
        return cast(Config, Config.from_name(model))
    if isinstance(model, dict):
        return Config(**model)
    if checkpoint is not None and os.path.isdir(checkpoint):
        return Config.from_checkpoint(Path(checkpoint))
    raise ValueError(
        "Give `model` (a litgpt config name, a dict of Config fields, a Config or a GPT), or a litgpt checkpoint"
        " directory as `checkpoint`."
    )


class CausalLM(pl.LightningModule):
    """Next-token training of litgpt's ``GPT`` pipelined by ``GPipeStrategy``, with AdamW; ``predict`` decodes greedily.

    Batches are ``(N, S)`` long token ids, or dicts with ``input_ids`` ``(N, S)`` and optionally ``labels`` ``(N, S)``
    (``-100`` where no loss is wanted; default the ids). The loss is the cross-entropy of each position's logits with
    the next position's label, the mean over the labelled targets (under ``schedule="1f1b"`` the mean of each
    micro-batch's, weighted by its rows: the same when rows hold as many targets each). Logged as ``train_loss`` and
    ``val_loss``.

    Args:
        model: a litgpt config name (``"pythia-160m"``), a dict of ``litgpt.Config`` fields, a ``Config``, or a ``GPT``
            (trained in place: its modules are the backbone's); ``None`` to take the config of ``checkpoint``'s
            directory.
        checkpoint: a ``lit_model.pth`` or a litgpt checkpoint directory to start from (each stage reads only its own
            tensors); ``None`` (default): a new model, initialised as litgpt's modules initialise themselves.
        lr: AdamW's learning rate. Default 3e-4.
        weight_decay: AdamW's decoupled weight decay. Default 0.0.
        betas: AdamW's betas. Default (0.9, 0.95).
        max_new_tokens: tokens ``predict_step`` adds at most. Default 32.
        eos_id: the end-of-sequence id ``predict_step`` stops at, or ``None`` (default).
        self_check: prove the cut on a miniature of the config first (default; see
            :func:`~lightning_gpipe.litgpt.selfcheck.check_cut`).

    Attributes:
        backbone: the ``nn.Sequential`` of :func:`~lightning_gpipe.litgpt.to_sequential`, after ``configure_model``.
        gpt: the ``GPT`` whose modules the backbone holds (not a submodule), ``None`` before ``configure_model``.

    Raises:
        ValueError: with neither a model nor a checkpoint directory, or for an unknown config name.
        SelfCheckError: if the backbone layers do not compute the config's ``GPT.forward``.
        FileNotFoundError: for a ``checkpoint`` that holds no ``lit_model.pth``.
    """

    def __init__(
        self,
        model: str | dict | Config | GPT | None = None,
        checkpoint: str | os.PathLike | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        max_new_tokens: int = 32,
        eos_id: int | None = None,
        self_check: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model"] if isinstance(model, (Config, GPT)) else None)
        self.lit_config = lit_config(model, checkpoint)
        self.__dict__["_given"] = model if isinstance(model, GPT) else None
        self.weights = None if checkpoint is None else LitCheckpoint(checkpoint)
        self.lr, self.weight_decay, self.betas = lr, weight_decay, cast("tuple[float, float]", tuple(betas))
        self.max_new_tokens, self.eos_id = max_new_tokens, eos_id
        if self_check:
            check_cut(self.lit_config)

    @property
    def gpt(self) -> GPT | None:
        """The ``GPT`` whose modules the backbone holds (``None`` before :meth:`configure_model`)."""
        return self.__dict__.get("_gpt")

    def configure_model(self) -> None:
        """Build the model on the meta device (or take the ``GPT`` given) and its backbone; outside
        ``GPipeStrategy`` also materialise it.

        Under ``GPipeStrategy`` this runs in its meta-device context: the strategy splits the backbone and each stage
        materialises only its layers, from ``checkpoint`` or initialised. Elsewhere the whole backbone is
        materialised here, on the current default device. Does nothing once built.
        """
        if self.gpt is not None:
            return
        model = self.__dict__["_given"]
        if model is None:
            with torch.device("meta"):
                model = GPT(self.lit_config)
        self.__dict__["_gpt"] = model
        self.backbone = to_sequential(model, self.weights, check=False)  # checked in __init__
        device = torch.empty(()).device
        if device.type != "meta":  # not under GPipeStrategy's sharded context: this process holds everything
            materialize(self.backbone, device)

    def batch_ids_and_labels(self, batch: Tensor | dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(input_ids, labels)`` of a batch (see the class)."""
        if isinstance(batch, Tensor):
            return batch, batch
        return batch["input_ids"], batch.get("labels", batch["input_ids"])

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """Next-token cross-entropy: the logits ``(N, S, V)`` of positions ``0 .. S-2`` against ``labels[:, 1:]``,
        mean over the targets other than ``-100``."""
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )

    def training_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """One step: the backbone on the ids, the loss, logged as ``train_loss``."""
        ids, labels = self.batch_ids_and_labels(batch)
        loss = self.loss(self.backbone(ids), labels)
        self.log("train_loss", loss, prog_bar=True, batch_size=ids.shape[0])
        return loss

    def validation_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> None:
        """Log ``val_loss``."""
        ids, labels = self.batch_ids_and_labels(batch)
        self.log("val_loss", self.loss(self.backbone(ids), labels), prog_bar=True, batch_size=ids.shape[0])

    def predict_step(self, batch: Tensor | dict[str, Tensor], batch_idx: int) -> Tensor:
        """Greedy continuations ``(N, S + T)`` of the batch's prompts (of one length), at most
        :attr:`max_new_tokens` new tokens, stopping at ``eos_id`` (:func:`~lightning_gpipe.litgpt.greedy_generate`)."""
        ids, _ = self.batch_ids_and_labels(batch)
        return greedy_generate(self.backbone, ids, self.max_new_tokens, self.eos_id)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over this stage's parameters."""
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=self.betas)
