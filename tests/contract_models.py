"""Models users bring, as the contract meets them: a torchvision-style ResNet whose layers modify their input in place,
and a module that keeps the whole model (``self.model``) beside its backbone (``self.backbone = self.model.blocks``).

Both train on :func:`images` (16 x 16 pixels, 3 classes) or :func:`models.loader`'s rows with SGD, so a pipelined
fit equals one device's to 1e-5.
"""

import lightning as L
import torch
import torch.nn.functional as F
from models import CLASSES, FEATURES
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class BasicBlock(nn.Module):
    """torchvision's ResNet ``BasicBlock`` (two 3x3 convolutions, ``ReLU(inplace=True)``, ``out += identity``) up to
    its last ReLU, which follows as a layer of its own; ``GroupNorm`` for ``BatchNorm2d`` (torchvision's
    ``norm_layer``): per sample, so micro-batches change nothing."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(2, planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(2, planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.GroupNorm(2, planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return out


class InplaceResNet(L.LightningModule):
    """A tiny torchvision-style ResNet as ``nn.Sequential(*children)``: stem (``conv1``, ``bn1``,
    ``ReLU(inplace=True)``), a block (with its downsampling) followed by its ``ReLU(inplace=True)``, pooling; the
    ``fc`` head after the backbone. Cuts before layers 2 and 4 start a stage with ``ReLU(inplace=True)`` on the
    received activation."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False),
            nn.GroupNorm(2, 8),
            nn.ReLU(inplace=True),
            BasicBlock(8, 16, stride=2),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(16, CLASSES)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.fc(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def images(rows: int = 24, batch_size: int = 8, seed: int = 0) -> DataLoader:
    """Random 3 x 16 x 16 images and labels: 3 batches of 8."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, 16, 16, generator=generator)
    y = torch.randint(0, CLASSES, (rows,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class SomeNet(nn.Module):
    """Stands for a library's model (a timm ``ConvNeXt``): ``blocks``, a head with a ``forward_head`` method, and a
    plain attribute."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.num_classes = CLASSES
        self.blocks = nn.Sequential(
            nn.Linear(FEATURES, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)
        )
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, CLASSES)

    def forward_head(self, x):
        return self.fc(self.norm(x))


class KeepsWholeModel(L.LightningModule):
    """A module that keeps the whole model: ``self.model = SomeNet()``, ``self.backbone = self.model.blocks``, and
    the head through the model, ``self.model.forward_head(self.backbone(x))``, which reads ``self.model.forward_head``
    before the backbone call, on every stage."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.model = SomeNet()
        self.backbone = self.model.blocks

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model.forward_head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def held_parameters(module: nn.Module) -> int:
    """Elements of the parameters ``module`` holds: each once, however many names lead to it; none on the meta
    device."""
    unique = {id(p): p for p in module.parameters() if not p.is_meta}
    return sum(p.numel() for p in unique.values())
