"""The operations an AmoebaNet-D cell applies to its hidden states.

Source: Real et al. 2019, "Regularized Evolution for Image Classifier
Architecture Search", Section 3 (search space), following the reference
TensorFlow TPU implementation trained in GPipe (Huang et al. 2019,
arXiv:1811.06965, Section 3.1): convolutions are ReLU-Conv-BN, the 3x3 and
1x7/7x1 convolutions use a 1x1 bottleneck to a quarter of the channels, and
padding gives the output sizes of TensorFlow "SAME" padding, so a stride-2
operation maps H to ceil(H / 2). Every operation maps (N, in_channels, H, W) to
(N, out_channels, H', W') with H' = ceil(H / stride).
"""

from collections.abc import Callable

import torch
from torch import Tensor, nn

BOTTLENECK_DIVISOR = 4
"""Bottleneck convolutions run at ``out_channels // 4`` channels (reference code)."""


def relu_conv_bn(
    in_channels: int,
    out_channels: int,
    kernel_size: int | tuple[int, int] = 1,
    stride: int | tuple[int, int] = 1,
) -> nn.Sequential:
    """ReLU, bias-free convolution padded by half the kernel (size-preserving at stride 1), then BatchNorm.

    Args:
        in_channels: channels of the (N, in_channels, H, W) input.
        out_channels: channels of the output.
        kernel_size: odd kernel size, an int or (height, width). Default 1.
        stride: stride, an int or (height, width). Default 1.
    """
    kernel = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
    padding = (kernel[0] // 2, kernel[1] // 2)
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=False),
        nn.BatchNorm2d(out_channels),
    )


def bottleneck_conv(in_channels: int, out_channels: int, stride: int, kernels: list[tuple[int, int]]) -> nn.Sequential:
    """1x1 down to a quarter of the channels, the given convolutions, 1x1 back up.

    Args:
        in_channels: input channels.
        out_channels: output channels; the inner width is ``out_channels // 4``.
        stride: applied by the inner convolutions (each one strides along the
            axes where its kernel is larger than 1).
        kernels: inner kernel sizes, e.g. ``[(3, 3)]`` or ``[(1, 7), (7, 1)]``.
    """
    inner = out_channels // BOTTLENECK_DIVISOR
    layers = [relu_conv_bn(in_channels, inner)]
    for kernel in kernels:
        kernel_stride = tuple(stride if k > 1 else 1 for k in kernel)
        layers.append(relu_conv_bn(inner, inner, kernel, kernel_stride))
    layers.append(relu_conv_bn(inner, out_channels))
    return nn.Sequential(*layers)


def max_pool(kernel_size: int, in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """Max pooling padded as TensorFlow "SAME" (odd extra on bottom/right), then a 1x1 Conv-BN if channels differ.

    Args:
        kernel_size: 2 or 3.
        in_channels: input channels.
        out_channels: output channels.
        stride: 1 or 2.
    """
    before, after = (kernel_size - 1) // 2, kernel_size // 2
    layer = nn.Sequential(
        nn.ConstantPad2d((before, after, before, after), float("-inf")),
        nn.MaxPool2d(kernel_size, stride),
    )
    return project_if_needed(layer, in_channels, out_channels)


def avg_pool_3x3(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """3x3 average pooling over the valid pixels only, then a 1x1 Conv-BN if channels differ.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: 1 or 2.
    """
    layer = nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)
    return project_if_needed(layer, in_channels, out_channels)


def project_if_needed(layer: nn.Module, in_channels: int, out_channels: int) -> nn.Module:
    """Append a 1x1 Conv-BN (no ReLU, as in the reference) to a pooling layer when channels differ.

    Args:
        layer: a channel-preserving pooling layer.
        in_channels: channels of its input.
        out_channels: channels wanted at the output.
    """
    if in_channels == out_channels:
        return layer
    projection = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
    return nn.Sequential(layer, projection)


def identity(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """The "none" operation: identity, or a ReLU-1x1-Conv-BN when shape changes.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        stride: 1 or 2.
    """
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return relu_conv_bn(in_channels, out_channels, 1, stride)


class FactorizedReduction(nn.Module):
    """Halves H and W without dropping pixels: two shifted stride-2 1x1 convolutions.

    Used on the previous-previous cell output when it has twice the resolution
    of the previous one (reference ``factorized_reduction``). Maps
    (N, in_channels, H, W) to (N, out_channels, ceil(H/2), ceil(W/2)).

    Args:
        in_channels: input channels.
        out_channels: output channels, even (each path gives half).
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.path1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.path2 = nn.Conv2d(in_channels, out_channels - out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        """Reduce ``x`` of shape (N, C, H, W); the second path is shifted by one pixel."""
        x = self.relu(x)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        return self.bn(torch.cat([self.path1(x), self.path2(shifted)], dim=1))


OperationBuilder = Callable[[int, int, int], nn.Module]
"""Builds an operation from (in_channels, out_channels, stride)."""

OPERATIONS: dict[str, OperationBuilder] = {
    "none": identity,
    "1x1": lambda c_in, c_out, stride: relu_conv_bn(c_in, c_out, 1, stride),
    "3x3": lambda c_in, c_out, stride: bottleneck_conv(c_in, c_out, stride, [(3, 3)]),
    "1x7_7x1": lambda c_in, c_out, stride: bottleneck_conv(c_in, c_out, stride, [(1, 7), (7, 1)]),
    "max_pool_2x2": lambda c_in, c_out, stride: max_pool(2, c_in, c_out, stride),
    "max_pool_3x3": lambda c_in, c_out, stride: max_pool(3, c_in, c_out, stride),
    "avg_pool_3x3": avg_pool_3x3,
}
"""Operation name (as in ``amoebanet.genotype``) to its builder."""
