"""Pipeline schedules: the order in which a stage runs its micro-batches' forwards and backwards.

A schedule is a small class over the primitives of :class:`~lightning_gpipe.stage.Stage` (take the
micro-batches, forward one, send, expect a gradient, recompute, backward one). It offers
``forward(value)`` (what the backbone call runs) and ``backward()`` (what ``Strategy.backward`` runs).
"""

from typing import Optional

from lightning_gpipe.microbatch import Value
from lightning_gpipe.stage import Stage


class GPipe:
    """GPipe's fill-drain schedule (Huang et al. 2019, section 2.2 and Figure 2).

    Fill: every micro-batch runs forward through the stage and is sent on. Drain: the micro-batches
    run backward in reverse order. A checkpointed micro-batch is recomputed *before* the stage waits
    for its gradient, so the recompute overlaps the next stage's backward of the same micro-batch; the
    next gradient's receive is posted while the current micro-batch computes.

    Args:
        stage: the stage to run.
    """

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def forward(self, value: Value) -> Optional[Value]:
        """The fill: run every micro-batch of the backbone input ``value`` through this stage.

        Returns:
            The backbone output of the whole mini-batch on the last stage; ``None`` on the others.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        stage, outputs = self.stage, []
        for i, x, count in stage.micro_batches(value):
            y = stage.forward(i, x, count)
            if stage.is_last:
                outputs.append(y)
            else:
                stage.send(y, i, count)
        if not stage.training:
            stage.flush()  # no drain follows to wait for the sends
        return stage.output(outputs) if stage.is_last else None

    def backward(self) -> None:
        """The drain: backpropagate every micro-batch of the last fill, in reverse order.

        On the last stage, the user's loss must have been backpropagated to the boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        stage = self.stage
        count = stage.begin_backward()
        if count:
            stage.expect_grad(count - 1)
        for i in reversed(range(count)):
            stage.recompute(i)  # before waiting for the gradient
            if i > 0:
                stage.expect_grad(i - 1)  # one ahead, so it lands while this one computes
            stage.backward(i)
        stage.flush()
