"""The one runtime: executes a stage's plan (:mod:`lightning_gpipe.schedule`) over the stage's primitives.

A plan is made for the step's number of micro-batches, which a stage learns from its first micro-batch (the first
stage scatters the backbone input; the others receive the count with the first activation). Lightning's two
phases are cut points in the plan: :meth:`Runtime.forward` (what the backbone call runs in ``training_step``) runs
the actions before the cut, :meth:`Runtime.backward` (what ``Strategy.backward`` runs) the rest. A schedule whose
last stage needs each micro-batch's loss during the step (1F1B) runs whole in :meth:`Runtime.step`. Evaluation runs
the forwards and sends of the fill, then waits for the sends. W actions that follow each other run as one call
(:meth:`Stage.backward_weights <lightning_gpipe.stage.Stage.backward_weights>`), which computes each plain linear
layer's weight gradient over their micro-batches as one matrix product.
"""

from collections.abc import Callable, Iterator
from typing import Optional

from lightning_gpipe.microbatch import Value
from lightning_gpipe.schedule import Action, Kind, Plan, check, plans
from lightning_gpipe.stage import Stage
from lightning_gpipe.watchdog import Position

Head = Callable[[int, int, Value], None]
"""The rest of the user's step on one micro-batch, on the last stage: ``head(index, count, output)`` computes the
micro-batch's loss from its backbone output and backpropagates it to the output (the stage's boundary)."""


class Runtime:
    """Runs one stage's plan of each step, in the order the schedule gives.

    Args:
        stage: the stage whose primitives the actions call.
        schedule: a name of :data:`lightning_gpipe.schedule.SCHEDULES`.
        num_stages: K, the stages of the pipeline.
        position: the stage's position (its run's :attr:`lightning_gpipe.job.Job.position`), which records the
            action being executed (number, kind, micro-batch) for the stall watchdog; none by default.

    Raises:
        ValueError: for an unknown schedule.
    """

    def __init__(self, stage: Stage, schedule: str, num_stages: int, position: Optional[Position] = None) -> None:
        self.stage, self.schedule, self.num_stages, self.position = stage, schedule, num_stages, position
        self._plans: dict[int, Plan] = {}  # by number of micro-batches
        self.per_micro_batch_loss = self.plan(1).loss_per_micro_batch
        self._plan: Optional[Plan] = None
        self._done = 0
        self._inputs: Optional[Iterator[tuple[int, Value, int]]] = None
        self._outputs: dict[int, Value] = {}
        self._count = 0

    def plan(self, count: int) -> Plan:
        """This stage's plan of a step of ``count`` micro-batches, made once per ``count``, when every stage's
        plans are checked (see :func:`~lightning_gpipe.schedule.check`).

        Raises:
            ScheduleError: if the plans could not run to their end, before any of their actions runs.
        """
        if count not in self._plans:
            stage = self.stage
            every = plans(self.schedule, self.num_stages, count, stage.checkpoint, stage.defer_weight_grad)
            check(every)
            self._plans[count] = every[stage.stage_index]
        return self._plans[count]

    def forward(self, value: Value) -> Optional[Value]:
        """The fill (``training_step``'s part of the plan), or in evaluation every forward and send.

        Returns:
            The backbone output of the whole mini-batch on the last stage; ``None`` on the others.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        plan = self._begin(value)
        if not self.stage.training:
            fill = [a for a in plan.actions if a.kind in (Kind.FORWARD, Kind.SEND)] + [Action(Kind.FLUSH)]
            plan = Plan(tuple(fill), cut=len(fill))
        self._run(plan, plan.cut)
        if not self.stage.is_last:
            return None
        return self.stage.output([self._outputs.pop(i) for i in range(self._count)])

    def backward(self) -> None:
        """The rest of the plan after the cut (fill-drain: the drain). On the last stage, the user's loss must have
        been backpropagated to the boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._plan is None:
            return
        if not self.stage.begin_backward():  # nothing to drain: a one-stage pipeline ran the step unsplit
            self.stage.flush()
        else:
            self._run(self._plan, len(self._plan.actions))
        self._plan = None

    def step(self, value: Optional[Value], head: Head) -> None:
        """Run the whole plan of one training step (schedules with a loss per micro-batch: 1F1B).

        Args:
            value: the backbone input of the whole mini-batch (used on the first stage only).
            head: on the last stage, called for each micro-batch's ``loss`` action (see :data:`Head`).

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        plan = self._begin(value)
        self._run(plan, len(plan.actions), head)
        self._plan = None

    def _begin(self, value: Value) -> Plan:
        """Take the step's micro-batches (the first one is needed to know their number) and make the plan."""
        inputs = self.stage.micro_batches(value)
        first = next(inputs, None)
        self._count = first[2] if first is not None else 0
        self._inputs = _chain(first, inputs)
        self._outputs, self._done = {}, 0
        self._plan = self.plan(self._count)
        return self._plan

    def _run(self, plan: Plan, end: int, head: Optional[Head] = None) -> None:
        """Execute ``plan.actions`` from where the last call stopped up to ``end``, each recorded in the position."""
        position, total, number = self.position, len(plan.actions), self._done
        try:
            while number < end:
                action = plan.actions[number]
                if position is not None:
                    position.act(number + 1, total, action.kind.value, action.micro_batch)
                if action.kind is Kind.WEIGHT:  # W back to back run at once (one product per linear layer)
                    together = _weights_from(plan.actions, number, end)
                    self.stage.backward_weights(together)
                    number += len(together)
                else:
                    self._execute(action, head)
                    number += 1
        finally:
            if position is not None:
                position.leave_plan()
        self._done = end

    def _execute(self, action: Action, head: Optional[Head]) -> None:
        """Run one action over the stage's primitives."""
        stage, kind, i = self.stage, action.kind, action.micro_batch
        if kind is Kind.FORWARD:
            index, x, count = next(self._inputs)
            self._outputs[index] = stage.forward(index, x, count)
        elif kind is Kind.SEND:
            stage.send(self._outputs.pop(i), i, self._count)
        elif kind is Kind.LOSS and i is not None:
            with stage.events.span("loss", i):
                head(i, self._count, self._outputs.pop(i))
        elif kind is Kind.EXPECT:
            stage.expect_grad(i)
        elif kind is Kind.RECOMPUTE:
            stage.recompute(i)
        elif kind is Kind.BACKWARD:
            stage.backward(i)
        elif kind is Kind.FLUSH:
            stage.flush()


def _weights_from(actions: tuple[Action, ...], start: int, end: int) -> list[int]:
    """The micro-batches of the W actions from ``actions[start]`` on, up to the first other action or ``end``."""
    indices = []
    for action in actions[start:end]:
        if action.kind is not Kind.WEIGHT:
            break
        indices.append(action.micro_batch)
    return indices


def _chain(first: Optional[tuple[int, Value, int]], rest: Iterator) -> Iterator[tuple[int, Value, int]]:
    if first is not None:
        yield first
        yield from rest
