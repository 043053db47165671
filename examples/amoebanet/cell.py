"""One AmoebaNet-D cell as a pipeline layer: (prev_prev, prev) in, (prev, output) out.

Source: Real et al. 2019, "Regularized Evolution for Image Classifier
Architecture Search", Section 3 and Figure 1 (cells take the two previous cell
outputs), as implemented in the reference TensorFlow TPU code that GPipe
(Huang et al. 2019, arXiv:1811.06965, Section 3.1) trained.
"""

import torch
from torch import Tensor, nn

from amoebanet.genotype import Genotype
from amoebanet.operations import OPERATIONS, FactorizedReduction, relu_conv_bn

CellStates = tuple[Tensor, Tensor]
"""Activation between cells: (previous-previous cell output, previous cell output)."""


class Cell(nn.Module):
    """An AmoebaNet-D normal or reduction cell.

    The input is either a single tensor (the stem output, for the first cell;
    it then serves as both previous and previous-previous output, as in the
    reference code) or a tuple ``(prev_prev, prev)`` of (N, C, H, W) tensors.
    The output is the tuple ``(prev, out)``: this cell's ``prev`` input passed on
    unchanged (the next cell's previous-previous input) and the new
    (N, len(concat) * channels, H / stride, W / stride) tensor.

    Args:
        genotype: which operations the cell applies (``amoebanet.genotype``).
        prev_channels: channels of ``prev``.
        prev_prev_channels: channels of ``prev_prev``, or ``None`` when the cell
            receives a single tensor.
        channels: width of every hidden state ("filters" in the paper).
        reduction: stride 2 (reduction cell) instead of 1 (normal cell).
        prev_prev_is_larger: ``prev_prev`` has twice the resolution of ``prev``
            (the previous cell was a reduction), so it is factorized-reduced.
    """

    def __init__(
        self,
        genotype: Genotype,
        prev_channels: int,
        prev_prev_channels: int | None,
        channels: int,
        reduction: bool,
        prev_prev_is_larger: bool,
    ) -> None:
        super().__init__()
        specs = [spec for step in genotype.steps for spec in step]
        self.inputs = [index for _, index in specs]
        self.concat = genotype.concat
        self.out_channels = len(genotype.concat) * channels
        self.preprocess_prev = relu_conv_bn(prev_channels, channels)
        self.preprocess_prev_prev, prev_prev_out = _preprocess_prev_prev(
            prev_channels, prev_prev_channels, channels, prev_prev_is_larger
        )
        state_channels = [channels, prev_prev_out] + [channels] * len(genotype.steps)
        self.operations = nn.ModuleList(
            OPERATIONS[name](state_channels[index], channels, 2 if reduction and index < 2 else 1)
            for name, index in specs
        )

    def forward(self, states: Tensor | CellStates) -> CellStates:
        """Run the five combination steps on ``states`` and return ``(prev, out)``."""
        prev_prev, prev = (states, states) if isinstance(states, Tensor) else states
        hidden = [self.preprocess_prev(prev), self.preprocess_prev_prev(prev_prev)]
        for step in range(0, len(self.operations), 2):
            left = self.operations[step](hidden[self.inputs[step]])
            right = self.operations[step + 1](hidden[self.inputs[step + 1]])
            hidden.append(left + right)
        return prev, torch.cat([hidden[i] for i in self.concat], dim=1)


def _preprocess_prev_prev(
    prev_channels: int, prev_prev_channels: int | None, channels: int, is_larger: bool
) -> tuple[nn.Module, int]:
    """Module matching ``prev_prev`` to the hidden-state shape, and its output channels.

    A single-tensor input is used as is (reference behaviour when there is no
    previous-previous cell); a larger one is factorized-reduced; a narrower or
    wider one is projected with ReLU-1x1-Conv-BN.
    """
    if prev_prev_channels is None:
        return nn.Identity(), prev_channels
    if is_larger:
        return FactorizedReduction(prev_prev_channels, channels), channels
    if prev_prev_channels != channels:
        return relu_conv_bn(prev_prev_channels, channels), channels
    return nn.Identity(), channels
