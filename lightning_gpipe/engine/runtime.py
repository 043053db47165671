"""The one runtime: executes a stage's plan (:mod:`lightning_gpipe.engine.schedule`) over the stage's primitives.

A plan is made for the step's number of micro-batches, which a stage learns from its first micro-batch (the first
stage scatters the backbone input; the others receive the count with the first activation). With several model
chunks per process (``virtual_stages``), each chunk is a :class:`~lightning_gpipe.engine.stage.Stage` of the virtual
pipeline of ``K * v`` stages, and an action runs on the chunk it names. Lightning's two phases are cut points in
the plan: :meth:`Runtime.forward` (what the backbone call runs in ``training_step``) runs the actions before the
cut, :meth:`Runtime.backward` (what ``Strategy.backward`` runs) the rest. A schedule whose last stage needs each
micro-batch's loss during the step (1F1B) runs whole in :meth:`Runtime.step`. Evaluation runs the forwards and
sends of fill-drain's fill (whatever the schedule), then waits for the sends. W actions that follow each other run
as one call (:meth:`Stage.backward_weights <lightning_gpipe.engine.stage.Stage.backward_weights>`), which computes each
plain linear layer's weight gradient over their micro-batches as one matrix product.
"""

from collections.abc import Callable, Iterator, Sequence
from typing import Optional

from lightning_gpipe.engine.microbatch import Value
from lightning_gpipe.engine.actions import Action, ActionCost, Kind, Plan
from lightning_gpipe.engine.schedule import V_SHAPED, check, evaluation, plans
from lightning_gpipe.engine.stage import Stage
from lightning_gpipe.faults.watchdog import Position

Head = Callable[[int, int, Value], None]
"""The rest of the user's step on one micro-batch, on the last stage: ``head(index, count, output)`` computes the
micro-batch's loss from its backbone output and backpropagates it to the output (the stage's boundary)."""


class Runtime:
    """Runs one process's plan of each step, in the order the schedule gives.

    Args:
        stages: the primitives of the process's model chunks, in chunk order: one :class:`Stage` (pipeline rank
            k), or with v virtual stages per process the stages of virtual ranks k, k + K, ... of ``K * v``.
        schedule: a name of :data:`lightning_gpipe.engine.schedule.SCHEDULES`.
        num_stages: K, the processes of the pipeline.
        position: the process's position (its run's :attr:`lightning_gpipe.faults.job.Job.position`), which records the
            action being executed (number, kind, micro-batch, chunk) for the stall watchdog; none by default.
        costs: one :class:`~lightning_gpipe.engine.actions.ActionCost` per virtual stage, for a schedule that places its
            actions by cost (``"zb-1p"``); ``None`` (default): equal costs.

    Raises:
        ValueError: for an unknown schedule.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: str,
        num_stages: int,
        position: Optional[Position] = None,
        costs: Optional[Sequence[ActionCost]] = None,
    ) -> None:
        self.stages, self.schedule, self.num_stages, self.position = list(stages), schedule, num_stages, position
        self.costs = costs
        self.stage_index = stages[0].stage_index  # the pipeline rank: chunk 0's virtual rank
        self._plans: dict[tuple[int, bool], Plan] = {}  # by (number of micro-batches, training)
        self.per_micro_batch_loss = self.plan(1).loss_per_micro_batch
        self._plan: Optional[Plan] = None
        self._done = 0
        self._inputs: list[Iterator[tuple[int, Value, int]]] = []
        self._outputs: dict[tuple[int, int], Value] = {}  # by (chunk, micro-batch)
        self._count = 0

    @property
    def is_last(self) -> bool:
        """Whether this process runs the pipeline's last (virtual) stage, after which the user's head follows."""
        return self.stages[-1].is_last

    def plan(self, count: int, training: bool = True) -> Plan:
        """This process's plan of a step of ``count`` micro-batches, made once per ``count``, when every stage's
        plans are checked (see :func:`~lightning_gpipe.engine.schedule.check`); with ``training=False`` the forwards and
        sends of fill-drain's fill, then a flush (:func:`~lightning_gpipe.engine.schedule.evaluation`).

        Raises:
            ScheduleError: if the plans could not run to their end, before any of their actions runs.
        """
        if (count, training) not in self._plans:
            stage, v, num_stages = self.stages[0], len(self.stages), self.num_stages
            if training:
                defer = stage.defer_weight_grad
                every = plans(self.schedule, num_stages, count, stage.checkpoint, defer, v, self.costs)
            else:
                every = evaluation(num_stages, count, v, self.schedule in V_SHAPED)
            check(every, training)
            self._plans[(count, training)] = every[self.stage_index]
        return self._plans[(count, training)]

    def forward(self, value: Value) -> Optional[Value]:
        """The fill (``training_step``'s part of the plan), or in evaluation every forward and send.

        Returns:
            The backbone output of the whole mini-batch on the last stage; ``None`` on the others.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        plan = self._begin(value)
        self._run(plan, plan.cut)
        if not self.is_last:
            return None
        last = len(self.stages) - 1
        return self.stages[-1].output([self._outputs.pop((last, i)) for i in range(self._count)])

    def backward(self) -> None:
        """The rest of the plan after the cut (fill-drain: the drain). On the last stage, the user's loss must have
        been backpropagated to the boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._plan is None:
            return
        if not sum(stage.begin_backward() for stage in self.stages):  # a one-stage pipeline ran the step unsplit
            self.stages[0].flush()
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
        """Take the step's micro-batches (the first one is needed to know their number) and make the plan. The
        chunks after the first take theirs when their first forward runs."""
        inputs = [stage.micro_batches(value) for stage in self.stages]
        first = next(inputs[0], None)
        self._count = first[2] if first is not None else 0
        self._inputs = [_chain(first, inputs[0]), *inputs[1:]]
        self._outputs, self._done = {}, 0
        self._plan = self.plan(self._count, self.stages[0].training)
        return self._plan

    def _run(self, plan: Plan, end: int, head: Optional[Head] = None) -> None:
        """Execute ``plan.actions`` from where the last call stopped up to ``end``, each recorded in the position."""
        position, total, number = self.position, len(plan.actions), self._done
        try:
            while number < end:
                action = plan.actions[number]
                if position is not None:
                    position.act(number + 1, total, action.kind.value, action.micro_batch, action.chunk)
                if action.kind is Kind.WEIGHT:  # W back to back run at once (one product per linear layer)
                    together = _weights_from(plan.actions, number, end)
                    self.stages[action.chunk].backward_weights(together)
                    number += len(together)
                else:
                    self._execute(action, head)
                    number += 1
        finally:
            if position is not None:
                position.leave_plan()
        self._done = end

    def _execute(self, action: Action, head: Optional[Head]) -> None:
        """Run one action over its chunk's primitives (a flush: every chunk's)."""
        kind, i, chunk = action.kind, action.micro_batch, action.chunk
        stage = self.stages[chunk]
        if kind is Kind.FORWARD:
            index, x, count = next(self._inputs[chunk])
            self._outputs[(chunk, index)] = stage.forward(index, x, count)
        elif kind is Kind.SEND:
            stage.send(self._outputs.pop((chunk, i)), i, self._count)
        elif kind is Kind.LOSS and i is not None:
            with stage.events.span("loss", i):
                head(i, self._count, self._outputs.pop((chunk, i)))
        elif kind is Kind.EXPECT:
            stage.expect_grad(i)
        elif kind is Kind.RECOMPUTE:
            stage.recompute(i)
        elif kind is Kind.BACKWARD:
            stage.backward(i)
        elif kind is Kind.FLUSH:
            for each in self.stages:
                each.flush()


def _weights_from(actions: tuple[Action, ...], start: int, end: int) -> list[int]:
    """The micro-batches of the W actions from ``actions[start]`` on, up to the first action of another kind or
    chunk, or ``end``."""
    indices = []
    for action in actions[start:end]:
        if action.kind is not Kind.WEIGHT or action.chunk != actions[start].chunk:
            break
        indices.append(action.micro_batch)
    return indices


def _chain(first: Optional[tuple[int, Value, int]], rest: Iterator) -> Iterator[tuple[int, Value, int]]:
    if first is not None:
        yield first
        yield from rest
