"""A step's gradients computed inside ``training_step`` and handed over in ``backward``, past Lightning's zero_grad.

Lightning's automatic optimization calls ``strategy.training_step``, then (on the first batch of an
accumulation window) the optimizer's ``zero_grad``, then ``strategy.backward``. Under 1F1B (PipeDream-Flush,
Narayanan et al. 2021) the backwards run inside ``training_step``, interleaved with the forwards, so their
gradients exist before ``zero_grad``. :class:`StepGradients` computes them out of Lightning's sight and
adds them to ``.grad`` in ``backward``: every hook around the step sees the gradients one device shows.
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import Tensor


class StepGradients:
    """One training step's gradients, set apart from the parameters' ``.grad`` until :meth:`hand_over`.

    While the step's gradients are computed, the gradients the parameters held before it are either freed, when
    Lightning zeroes them after this ``training_step`` anyway (the first batch of an accumulation window: the
    previous step's gradients), so that a stage never holds two sets; or kept aside, within an accumulation
    window, and given back for Lightning (which does not zero them then) before the step's are added.
    """

    def __init__(self) -> None:
        self._computed: list[tuple[Tensor, Tensor | None]] = []

    @contextmanager
    def computing(self, parameters: Sequence[Tensor], zeroed_after: bool) -> Iterator[None]:
        """Inside the block, ``parameters`` start with no ``.grad``; afterwards the gradients computed in it are
        kept for :meth:`hand_over` and the parameters get their earlier ``.grad`` back, or none if
        ``zeroed_after`` (Lightning zeroes the gradients between this ``training_step`` and ``backward``)."""
        earlier = [None if zeroed_after else p.grad for p in parameters]
        for p in parameters:
            p.grad = None
        try:
            yield
        finally:
            self._computed = [(p, p.grad) for p in parameters]
            for p, grad in zip(parameters, earlier):
                p.grad = grad

    def hand_over(self) -> None:
        """Add the gradients computed by the last :meth:`computing` block to the parameters' ``.grad``."""
        computed, self._computed = self._computed, []
        for p, grad in computed:
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
