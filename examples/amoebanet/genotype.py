"""The AmoebaNet-D cell genotype.

Source: Real et al. 2019, "Regularized Evolution for Image Classifier
Architecture Search" (AAAI), Section 3 and Appendix A (the AmoebaNet cells),
as released in the reference TensorFlow TPU implementation that the GPipe paper
(Huang et al. 2019, arXiv:1811.06965, Section 3.1 and Table 1) trained.

A cell holds a list of hidden states. State 0 is the previous cell's output
after a 1x1 projection, state 1 is the cell before that (projected to the same
shape when needed). Each of the five combination steps reads two states,
applies one operation to each and adds the results, appending a new state
(states 2 to 6). The cell output concatenates some states along channels.
"""

from typing import NamedTuple

OperationSpec = tuple[str, int]
"""One operation of a combination step: (operation name, index of the hidden state it reads)."""


class Genotype(NamedTuple):
    """One cell type of the AmoebaNet-D search result.

    Attributes:
        steps: the five combination steps, each a (left, right) pair of
            ``OperationSpec``; operation names are keys of
            ``amoebanet.operations.OPERATIONS``.
        concat: indices of the hidden states concatenated into the cell output.
    """

    steps: tuple[tuple[OperationSpec, OperationSpec], ...]
    concat: tuple[int, ...]


NORMAL_CELL = Genotype(
    steps=(
        (("1x1", 1), ("max_pool_3x3", 1)),
        (("none", 1), ("1x7_7x1", 0)),
        (("1x1", 0), ("1x7_7x1", 0)),
        (("max_pool_3x3", 2), ("none", 2)),
        (("avg_pool_3x3", 1), ("1x1", 5)),
    ),
    # The paper's figure suggests (4, 5, 6); the reference implementation used by
    # GPipe concatenates (0, 3, 4, 6), which is what reproduces GPipe Table 1.
    concat=(0, 3, 4, 6),
)
"""Normal cell (stride 1): keeps resolution, output has 4 x channels."""

REDUCTION_CELL = Genotype(
    steps=(
        (("max_pool_2x2", 0), ("max_pool_3x3", 0)),
        (("none", 2), ("3x3", 1)),
        (("1x7_7x1", 2), ("max_pool_3x3", 2)),
        (("none", 3), ("max_pool_2x2", 1)),
        (("avg_pool_3x3", 2), ("1x1", 3)),
    ),
    concat=(4, 5, 6),
)
"""Reduction cell (stride 2 on states 0 and 1): halves resolution, 3 x channels."""
