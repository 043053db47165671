"""The user contract at the backbone call: one pipelined call per step, and the step ends there on early stages.

Every stage runs the user's step (``training_step``, ``validation_step``...) up to the backbone
call. That call runs the pipeline (:class:`BackboneCall`, installed in the stage's
:class:`~lightning_gpipe.partition.Partition`); on every stage but the last it then raises
:class:`BackboneReached`, which ends the user's step there: the rest of the step (head, loss,
logging) belongs to the last stage. :meth:`BackboneCall.user_step` runs one step of the user's
under that contract and checks it called the backbone exactly once.
"""

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from lightning_gpipe.microbatch import Value
from lightning_gpipe.partition import Partition


class BackboneReached(BaseException):
    """Ends a user's step at the backbone call, on stages where the rest of the step does not run.

    A ``BaseException``, so that a user's ``except Exception`` cannot swallow it. Raised by
    :class:`BackboneCall` on stages before the last, and by the balance profiler's stand-in backbone
    (:mod:`lightning_gpipe.balance.backbone`), which needs only the backbone's input.
    """


class Schedule(Protocol):
    """A pipeline schedule as the contract sees it (:class:`lightning_gpipe.schedule.GPipe`)."""

    def forward(self, value: Value) -> Optional[Value]:
        """Run the forward of every micro-batch of ``value``; the backbone output on the last stage, else ``None``."""


class BackboneCall:
    """The call a stage's :class:`~lightning_gpipe.partition.Partition` goes through, and the step guard around it.

    Args:
        schedule: runs the forward of the pipeline on this stage.
        is_last: whether this is the last stage, where the user's step goes on after the backbone call.
        share: sends a picklable object from the last stage to every stage of the pipeline and returns it
            (a collective call); the identity by default, for a single process.
    """

    def __init__(self, schedule: Schedule, is_last: bool, share: Callable[[Any], Any] = lambda obj: obj) -> None:
        self.schedule, self.is_last, self.share = schedule, is_last, share
        self._plain = self._shared = 0

    def __call__(self, value: Value) -> Value:
        """The pipelined forward of the backbone input ``value`` (ignored on stages after the first).

        Returns:
            On the last stage, the backbone output of the whole mini-batch.

        Raises:
            BackboneReached: on every stage but the last, once its micro-batches are sent.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._plain += 1
        output = self.schedule.forward(value)
        if not self.is_last:
            raise BackboneReached
        return output

    def forward_and_share(self, value: Value, fn: Callable[[Value], Any]) -> Any:
        """Run the backbone on ``value`` without gradients, apply ``fn`` to its output on the last stage,
        and return ``fn``'s result on every stage. See :func:`forward_and_share`.

        Raises:
            RuntimeError: with gradients enabled, or after this step's plain backbone call.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                "`forward_and_share` runs the backbone without gradients, for evaluation and decoding; call it"
                " under `torch.no_grad()` or from `validation_step`, `test_step` or `predict_step`."
            )
        if self._plain:
            raise RuntimeError(
                "`forward_and_share` was called after this step's plain backbone call, which ends the step on"
                " every stage but the last; call the backbone plainly last, or only through `forward_and_share`."
            )
        self._shared += 1
        output = self.schedule.forward(value)
        return self.share(fn(output) if self.is_last else None)

    def user_step(self, hook: str, step: Callable[[], Any]) -> Any:
        """Run one call of the user's ``hook`` (``"training_step"``...) as ``step()``, ending early stages at the
        backbone call.

        Returns:
            The step's output on the last stage; ``None`` on the others.

        Raises:
            RuntimeError: if the step called the backbone more than once, or never (plainly or through
                :func:`forward_and_share`).
        """
        self._plain = self._shared = 0
        try:
            output = step()
        except BackboneReached:
            output = None
        if self._plain > 1 or (self._plain == 0 and self._shared == 0):
            raise RuntimeError(
                f"`{hook}` called the pipelined backbone {self._plain} times; it must call it exactly once per step"
                " (GPipeStrategy splits that one call into micro-batches). To call it several times in evaluation,"
                " e.g. for autoregressive decoding, use `lightning_gpipe.forward_and_share`."
            )
        return output


def forward_and_share(backbone: nn.Module, value: Value, fn: Callable[[Value], Any]) -> Any:
    """Call ``backbone(value)``, apply ``fn`` to its output, and return the result on every stage.

    A pipelined backbone's output exists on the last stage only, and a plain backbone call ends
    the user's step on the other stages. Loops that feed an output back into the backbone, such as
    greedy or beam decoding, need that output everywhere: this runs the pipelined forward
    (micro-batched, no gradients), applies ``fn`` on the last stage and sends its result (keep it
    small, e.g. the next token ids) to every stage, so all stages go round the loop together. The
    same approach as Megatron-LM's text generation, which broadcasts new tokens from the last stage.
    Without a pipeline (one device, other strategies) it is ``fn(backbone(value))``.

    Args:
        backbone: the module's backbone attribute (``self.backbone``).
        value: the backbone input, as for a plain call.
        fn: maps the backbone output of the whole batch to a picklable result.

    Raises:
        RuntimeError: with gradients enabled, or when called after the step's plain backbone call.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    pipeline = backbone.pipeline if isinstance(backbone, Partition) else None
    if pipeline is None:
        return fn(backbone(value))
    return pipeline.forward_and_share(value, fn)
