"""AmoebaNet-D (L, D) as one ``nn.Sequential`` for pipeline parallelism.

Source: the architecture is from Real et al. 2019, "Regularized Evolution for
Image Classifier Architecture Search" (AAAI), Section 3 and Figure 1 (stem,
three stacks of N normal cells separated by two reduction cells); GPipe
(Huang et al. 2019, arXiv:1811.06965), Section 3.1 and Table 1, scales it as
AmoebaNet-D (L, D) with L normal cells in total and D filters, e.g. (18, 208)
with 82M parameters for ImageNet.

Layers of the returned Sequential and the activation between them
(N = batch, C = channels):

- ``stem``: image (N, 3, H, W) -> Tensor (N, C, H', W').
- ``stem_reduction1``, ``stem_reduction2`` (ImageNet stem only) and every
  ``normal{stack}_{i}`` / ``reduction{stack}`` cell: Tensor or
  ``(prev_prev, prev)`` -> ``(prev, out)`` tuple of two (N, C, H, W) tensors.
- ``head``: ``(prev, out)`` -> logits (N, num_classes); ``prev`` is unused.
"""

from collections import OrderedDict
from collections.abc import Iterator

from torch import Tensor, nn

from amoebanet.cell import Cell, CellStates
from amoebanet.genotype import NORMAL_CELL, REDUCTION_CELL

IMAGENET_STEM_MIN_SIZE = 128
"""Images at least this large get the ImageNet stem (32x downsampling overall)."""

NUM_STACKS = 3
"""Stacks of normal cells; a reduction cell sits between consecutive stacks."""


class Stem(nn.Module):
    """First layer: 3x3 convolution and BatchNorm on the image (no ReLU, as in the reference).

    Args:
        out_channels: output channels ("stem_reduction_size" in the reference code).
        stride: 2 for the ImageNet stem, 1 for the CIFAR stem.

    Input (N, 3, H, W) float images; output (N, out_channels, ceil(H/stride), ceil(W/stride)).
    """

    def __init__(self, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, out_channels, 3, stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, images: Tensor) -> Tensor:
        """Return the stem features of ``images``."""
        return self.bn(self.conv(images))


class Head(nn.Module):
    """Classifier: ReLU, global average pooling and a linear layer on the last cell output.

    Args:
        in_channels: channels of the last cell output.
        num_classes: number of logits.

    Input ``(prev, out)`` from the last cell; output logits (N, num_classes).
    """

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, states: CellStates) -> Tensor:
        """Return logits for the newest tensor of ``states``."""
        return self.fc(self.pool(self.relu(states[-1])).flatten(1))


def amoebanetd(
    num_classes: int = 10,
    num_layers: int = 6,
    num_filters: int = 16,
    image_size: int = 32,
    stem_filters: int = 32,
) -> nn.Sequential:
    """Build AmoebaNet-D (L=num_layers, D=num_filters) as a flat ``nn.Sequential``.

    Source: Real et al. 2019 (Section 3, Figure 1; Appendix A for AmoebaNet-D)
    and GPipe, Huang et al. 2019, arXiv:1811.06965 (Section 3.1, Table 1:
    (18, 208) = 82M, (18, 416) = 318M, (18, 544) = 542M parameters for
    ImageNet with ``num_classes=1000, image_size=224``).

    Args:
        num_classes: number of output logits. Default 10 (CIFAR-10).
        num_layers: L, normal cells in total, split evenly over 3 stacks, so a
            positive multiple of 3. Default 6.
        num_filters: D, hidden-state width of the first stack; the second and
            third stacks use 2D and 4D. Default 16 (with L=6: a CPU-sized
            CIFAR-10 model of about 0.17M parameters).
        image_size: input height/width. Sizes of at least 128 use the ImageNet
            stem (stride-2 conv, then two reduction cells at D/4 and D/2
            filters); smaller ones (e.g. 32) use the CIFAR stem (a stride-1
            conv). Default 32.
        stem_filters: channels of the stem convolution. Default 32 (reference).

    Returns:
        ``nn.Sequential`` mapping images (N, 3, image_size, image_size) to
        logits (N, num_classes); between layers the activation is a Tensor or
        a ``(prev_prev, prev)`` tuple (see the module docstring).
    """
    if num_layers <= 0 or num_layers % NUM_STACKS:
        raise ValueError(f"num_layers must be a positive multiple of {NUM_STACKS}, got {num_layers}")
    imagenet = image_size >= IMAGENET_STEM_MIN_SIZE
    layers: OrderedDict[str, nn.Module] = OrderedDict(stem=Stem(stem_filters, stride=2 if imagenet else 1))
    prev_channels, prev_prev_channels, prev_reduction = stem_filters, None, False
    for name, channels, reduction in _cell_plan(num_layers // NUM_STACKS, num_filters, imagenet):
        cell = Cell(
            REDUCTION_CELL if reduction else NORMAL_CELL,
            prev_channels,
            prev_prev_channels,
            channels,
            reduction,
            prev_prev_is_larger=prev_reduction,
        )
        layers[name] = cell
        prev_channels, prev_prev_channels, prev_reduction = cell.out_channels, prev_channels, reduction
    layers["head"] = Head(prev_channels, num_classes)
    return nn.Sequential(layers)


def _cell_plan(cells_per_stack: int, num_filters: int, imagenet_stem: bool) -> Iterator[tuple[str, int, bool]]:
    """Yield ``(layer name, filters, is_reduction)`` for every cell in order."""
    if imagenet_stem:
        yield "stem_reduction1", num_filters // 4, True
        yield "stem_reduction2", num_filters // 2, True
    for stack in range(1, NUM_STACKS + 1):
        filters = num_filters * 2 ** (stack - 1)
        if stack > 1:
            yield f"reduction{stack - 1}", filters, True
        for index in range(1, cells_per_stack + 1):
            yield f"normal{stack}_{index}", filters, False
