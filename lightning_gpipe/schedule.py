"""Pipeline schedules: the order in which a stage runs its micro-batches' forwards and backwards.

A schedule is a small class over the primitives of :class:`~lightning_gpipe.stage.Stage` (take the
micro-batches, forward one, send, expect a gradient, recompute, backward one). :class:`GPipe` offers
``forward(value)`` (what the backbone call runs) and ``backward()`` (what ``Strategy.backward`` runs);
:class:`OneForwardOneBackward` runs a whole training step with ``step(value, head)``, the head being the
rest of the user's step on each micro-batch, which it needs before the next forward.
"""

from collections.abc import Callable
from typing import Optional

from lightning_gpipe.microbatch import Value
from lightning_gpipe.stage import Stage


class GPipe:
    """GPipe's fill-drain schedule (Huang et al. 2019, section 2.2 and Figure 2).

    Fill: every micro-batch runs forward through the stage and is sent on. Drain: the micro-batches
    run backward in reverse order. A checkpointed micro-batch is recomputed *before* the stage waits
    for its gradient, so the recompute overlaps the next stage's backward of the same micro-batch; the
    next gradient's receive is posted while the current micro-batch computes. With deferred weight
    gradients (zero-bubble's B/W split), a stage sends each input gradient before computing the weight
    gradient, so the previous stage starts that micro-batch's backward one weight gradient earlier; the last
    stage without re-materialization runs every weight gradient after its last input gradient
    (:func:`weights_after_drain`).

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
        at_end = weights_after_drain(stage.is_last, stage.checkpoint)
        for i in reversed(range(count)):
            stage.recompute(i)  # before waiting for the gradient
            if i > 0:
                stage.expect_grad(i - 1)  # one ahead, so it lands while this one computes
            stage.backward(i)  # sends the input gradient as soon as it is computed
            if not at_end:
                stage.backward_weights()  # deferred weight gradient, if any: while the previous stage works
        stage.backward_weights()
        stage.flush()


def weights_after_drain(is_last: bool, checkpoint: str) -> bool:
    """Whether fill-drain runs a stage's deferred weight gradients (W) after its whole drain, not after each B.

    The last stage waits for no gradient, so every W it runs before its next B delays the previous stage by
    that W. With ``checkpoint="never"`` it holds every micro-batch's graph at the end of the fill anyway, so
    running all B first and all W after them (zero-bubble's placement of W where nothing waits for it, Qi et
    al. 2023, section 3) raises no peak but that of the kept gradients at the layers (about one activation per
    layer with parameters and micro-batch). With re-materialization the recomputed graphs would pile up
    instead, so there, and on the other stages (which wait for gradients), W follows each B.

    Args:
        is_last: whether the stage is the pipeline's last.
        checkpoint: the re-materialization mode (:data:`lightning_gpipe.rematerialization.CHECKPOINT_MODES`).
    """
    return is_last and checkpoint == "never"


Head = Callable[[int, int, Value], None]
"""The rest of the user's step on one micro-batch, on the last stage: ``head(index, count, output)`` computes the
micro-batch's loss from its backbone output and backpropagates it to the output (the stage's boundary)."""


class OneForwardOneBackward:
    """The 1F1B schedule of PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
    Training", section 3; the default of Megatron-LM, DeepSpeed and torchtitan).

    Stage k of K runs ``min(K - k - 1, M)`` warm-up forwards, then alternates one forward and one backward
    (forward ``i`` is followed by the backward of micro-batch ``i - (K - k - 1)``), then the remaining
    backwards. Micro-batch i's backward starts as soon as its loss exists, so stage k holds at most
    ``min(K - k, M)`` micro-batches in flight instead of GPipe's M; the gradients are the same (one flush, one
    optimizer step per mini-batch), and with equal stages so is the bubble, ``(K - 1) / (M + K - 1)``.

    Transfers cannot deadlock: sends are asynchronous, a stage blocks only to receive what an earlier stage's
    (or a later stage's) program order sends before it blocks in turn, and receives are posted in the order
    the matching sends are issued. Activations go one way in micro-batch order (the link posts each next
    header ahead); gradients come back the other way, also in micro-batch order, and each one's receive is
    posted right after the micro-batch's activation is sent, so it lands while the stage computes. A
    checkpointed micro-batch is recomputed before its gradient is awaited; with deferred weight gradients
    (``Stage(defer_weight_grad=True)``) each backward sends its input gradient, then computes the weight
    gradient at once. In the steady phase, after each forward, the stage waits for its earlier sends (by then
    received: the next stage consumed them before sending the gradient this stage last received), so sent
    tensors are freed with their micro-batch.

    Evaluation needs no schedule: the strategy keeps :meth:`GPipe.forward` for it.

    Args:
        stage: the stage to run.
        num_stages: K, the stages of the pipeline.
    """

    def __init__(self, stage: Stage, num_stages: int) -> None:
        self.stage, self.num_stages = stage, num_stages

    def step(self, value: Optional[Value], head: Head) -> None:
        """Run one training step of this stage: every micro-batch's forward and backward, in 1F1B order.

        Args:
            value: the backbone input of the whole mini-batch (used on the first stage only).
            head: on the last stage, called after each micro-batch's forward, before its backward (see
                :data:`Head`); unused elsewhere.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        stage, warmup = self.stage, self.num_stages - 1 - self.stage.stage_index
        count = 0
        for i, x, count in stage.micro_batches(value):
            y = stage.forward(i, x, count)
            if i > warmup:
                stage.flush()  # the earlier sends have landed: free them with their micro-batches
            if stage.is_last:
                with stage.events.span("loss", i):
                    head(i, count, y)
            else:
                stage.send(y, i, count)
                stage.expect_grad(i)  # gradients come back in micro-batch order
            if i >= warmup:
                self._backward(i - warmup)
        for j in range(max(count - warmup, 0), count):
            self._backward(j)
        stage.flush()

    def _backward(self, index: int) -> None:
        self.stage.recompute(index)  # before waiting for the gradient
        self.stage.backward(index)  # sends the input gradient as soon as it is computed
        self.stage.backward_weights()  # deferred weight gradient, if any
