"""The benchmark models and their synthetic data, importable by other tools (e.g. a schedule simulator).

The balanced MLP: a backbone of ``depth`` x (``Linear(width, width)``, ``ReLU``) (``2 * depth`` layers), then
a ``Linear(width, 10)`` head and cross-entropy against random labels. :class:`MLPClassifier` is its
LightningModule (layers built in ``configure_model``); :func:`mlp_sequential` the same layers as one plain
``nn.Sequential`` for the pipelines that take one (torch.distributed.pipelining, torchgpipe). The AmoebaNet-D
benchmark model is the example's :func:`amoebanet_classifier` on random images; the translation model is the example's
Transformer (:func:`translation_module`) on a real batch of the shipped Multi30k subset (:func:`translation_batch`).

Import as ``benchmarks.models`` from the repository root, or as ``models`` from a script in ``benchmarks/``.
"""

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

REPO = Path(__file__).resolve().parents[1]
NUM_CLASSES = 10


def mlp_backbone(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """The balanced backbone: ``depth`` x (``Linear(width, width)``, ``ReLU``), ``2 * depth`` layers in all."""
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def mlp_sequential(width: int = 1024, depth: int = 8) -> nn.Sequential:
    """The whole MLP as one ``nn.Sequential``: the backbone's layers, then the ``Linear(width, 10)`` head."""
    return nn.Sequential(*mlp_backbone(width, depth), nn.Linear(width, NUM_CLASSES))


class MLPClassifier(pl.LightningModule):
    """The balanced MLP with cross-entropy and SGD; the layers are built in :meth:`configure_model`.

    Args:
        width: features of every Linear layer. Default 1024.
        depth: (Linear, ReLU) pairs in the backbone. Default 8.
        lr: SGD learning rate. Default 1e-3.
        momentum: SGD momentum (0: none, no optimizer state). Default 0.
    """

    def __init__(self, width: int = 1024, depth: int = 8, lr: float = 1e-3, momentum: float = 0.0) -> None:
        super().__init__()
        self.width, self.depth, self.lr, self.momentum = width, depth, lr, momentum
        self.backbone: nn.Sequential | None = None
        self.head: nn.Linear | None = None

    def configure_model(self) -> None:
        """Build the backbone and the head (once), under the strategy's device context."""
        if self.backbone is None:
            self.backbone = mlp_backbone(self.width, self.depth)
            self.head = nn.Linear(self.width, NUM_CLASSES)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy of the head's logits on the backbone's output."""
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD over the parameters this process holds."""
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def amoebanet_classifier(num_layers: int = 6, num_filters: int = 16, channels_last: bool = False) -> pl.LightningModule:
    """The AmoebaNet-D (L, D) example's LightningModule for 32 x 32 images (examples/amoebanet, CPU config);
    ``channels_last``: its weights and inputs in ``torch.channels_last`` memory format."""
    _examples_on_path()
    from amoebanet.module import AmoebaNetClassifier

    return AmoebaNetClassifier(
        num_layers=num_layers, num_filters=num_filters, image_size=32, channels_last=channels_last
    )


def translation_module(layers: int = 3) -> pl.LightningModule:
    """The translation example's Transformer (``examples/translation/configs/cpu.yaml``'s model: d_model 256, the
    shipped 8,000-word vocabulary) with ``layers`` encoder and ``layers`` decoder layers (default 3, the config's),
    without decoding in validation."""
    _examples_on_path()
    from translation.module import TranslationModule

    return TranslationModule(decode=False, num_encoder_layers=layers, num_decoder_layers=layers)


def translation_batch(max_tokens: int = 4096) -> dict:
    """The first training batch of the translation example's data module on its shipped Multi30k subset, batches of
    at most ``max_tokens`` padded tokens per side (4,096, the CPU config's: 113 sentence pairs)."""
    _examples_on_path()
    from translation.data import TranslationDataModule

    data = TranslationDataModule(max_tokens=max_tokens)
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _examples_on_path() -> None:
    examples = str(REPO / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)


def mlp_batch(rows: int, width: int = 1024, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A synthetic mini-batch for the MLP: ``(rows, width)`` normal inputs and ``rows`` random labels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=generator), torch.randint(0, NUM_CLASSES, (rows,), generator=generator)


def image_batch(rows: int, size: int = 32, seed: int = 0) -> tuple[Tensor, Tensor]:
    """A synthetic mini-batch of ``rows`` normal ``3 x size x size`` images and random labels."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(rows, 3, size, size, generator=generator)
    return images, torch.randint(0, NUM_CLASSES, (rows,), generator=generator)


class Repeat(torch.utils.data.Dataset):
    """The same mini-batch ``length`` times: a data set with no loading cost (use ``batch_size=None``); ``fresh``:
    a copy of its tensors each time, as a loader that collates makes a new batch (so that memory measurements see
    it)."""

    def __init__(self, batch: Any, length: int, fresh: bool = False) -> None:
        self.batch, self.length, self.fresh = batch, length, fresh

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        return pytree.tree_map_only(Tensor, Tensor.clone, self.batch) if self.fresh else self.batch


def repeat_loader(batch: Any, length: int, fresh: bool = False) -> torch.utils.data.DataLoader:
    """A DataLoader yielding ``batch`` ``length`` times (copies if ``fresh``), in the main process."""
    dataset = Repeat(batch, length, fresh)
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False, num_workers=0)
