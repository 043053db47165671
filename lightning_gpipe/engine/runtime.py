"""The one runtime: executes a process's plan (:mod:`lightning_gpipe.engine.schedule`) over its model chunks.

A plan is made for the step's number of micro-batches M, which a process learns as its first model chunk takes its
inputs (the first stage scatters the backbone input; the others learn M from the previous stage). With several
model chunks per process (``virtual_stages``), each is a :class:`~lightning_gpipe.engine.model_chunk.ModelChunk`, a
virtual stage of the pipeline of ``K * v``, and an action runs on the model chunk it names.

Lightning's two phases are one cut in the plan: :meth:`Runtime.forward` (what the backbone call runs in
``training_step``) runs the actions before the cut, :meth:`Runtime.backward` (what ``Strategy.backward`` runs) the
rest. Under fill-drain the cut follows the fill and the user's loss runs on the whole mini-batch between the two;
a schedule whose last stage needs each micro-batch's loss during the step (1F1B, zero-bubble) has its cut at the
end, and its ``loss`` actions call a head per micro-batch (see :mod:`lightning_gpipe.lightning.step`, which shows
both protocols side by side); where each micro-batch's backward follows its loss at once, the loss backpropagates
through the last stage in the same autograd call (:attr:`ModelChunk.loss_through
<lightning_gpipe.engine.model_chunk.ModelChunk.loss_through>`). Evaluation runs the forwards and sends of fill-drain's
fill (whatever the schedule), then waits for the sends. W actions that follow each other run as one call
(:meth:`ModelChunk.backward_weights <lightning_gpipe.engine.model_chunk.ModelChunk.backward_weights>`), which computes
each plain linear layer's weight gradient over their micro-batches as one matrix product.
"""

from collections.abc import Callable, Iterator, Sequence

from lightning_gpipe.engine.actions import Action, ActionCost, Kind, Plan
from lightning_gpipe.engine.microbatch import Value
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.schedule import V_SHAPED, check, evaluation, plans
from lightning_gpipe.faults.watchdog import Position

Head = Callable[[int, int, Value], None]
"""The rest of the user's step on one micro-batch, on the last stage: ``head(index, micro_batches, output)`` computes
the micro-batch's loss from its backbone output and backpropagates it to the output (the stage's boundary)."""


class Runtime:
    """Runs one process's plan of each step, in the order the schedule gives.

    Args:
        model_chunks: the process's model chunks, in order: one :class:`ModelChunk` (virtual stage k of K), or with v
            per process those of virtual stages k, k + K, ... of ``K * v`` (or as a V places them).
        schedule: a name of :data:`lightning_gpipe.engine.schedule.SCHEDULES`.
        num_stages: K, the processes of the pipeline.
        position: the process's position (its run's :attr:`lightning_gpipe.faults.job.Job.position`), which records
            the action being executed (number, kind, micro-batch, model chunk) for the stall watchdog; none by default.
        costs: one :class:`~lightning_gpipe.engine.actions.ActionCost` per virtual stage, for a schedule that places
            its actions by cost (``"zb-1p"``, ``"zb-v"``); ``None`` (default): equal costs.

    Attributes:
        stage: the process's pipeline rank.
        loss_per_micro_batch: whether the plans call a head per micro-batch (the cut is at the end of the plan).
        before_first_backward: called once per training step, right before the process's first action that
            backpropagates through it (a recompute, a backward, a weight gradient, or a micro-batch's loss); set
            through :meth:`~lightning_gpipe.engine.StagePipeline.on_backward_start`. ``None`` (default): nothing.

    Raises:
        ValueError: for an unknown schedule.
    """

    def __init__(
        self,
        model_chunks: Sequence[ModelChunk],
        schedule: str,
        num_stages: int,
        position: Position | None = None,
        costs: Sequence[ActionCost] | None = None,
    ) -> None:
        self.model_chunks, self.schedule, self.num_stages = list(model_chunks), schedule, num_stages
        self.position, self.costs = position, costs
        self.stage = model_chunks[0].virtual_stage  # model chunk 0's virtual stage is the pipeline rank
        self._plans: dict[tuple[int, bool], Plan] = {}  # by (number of micro-batches, training)
        self.loss_per_micro_batch = self.plan(1).loss_per_micro_batch
        self._plan: Plan | None = None
        self._done = 0
        self._inputs: list[Iterator[tuple[int, Value, int]]] = []
        self._outputs: dict[tuple[int, int], Value] = {}  # by (model chunk, micro-batch)
        self._micro_batches = 0
        self.before_first_backward: Callable[[], None] | None = None
        self._backward_begun = True  # in the current step (evaluation never begins one)

    @property
    def is_last(self) -> bool:
        """Whether this process runs the pipeline's last (virtual) stage, after which the user's head follows."""
        return self.model_chunks[-1].is_last

    def plan(self, micro_batches: int, training: bool = True) -> Plan:
        """This process's plan of a step of ``micro_batches`` micro-batches, made once per M, when every stage's plans
        are checked (see :func:`~lightning_gpipe.engine.schedule.check`); with ``training=False`` the forwards and
        sends of fill-drain's fill, then a flush (:func:`~lightning_gpipe.engine.schedule.evaluation`).

        Raises:
            ScheduleError: if the plans could not run to their end, before any of their actions runs.
        """
        if (micro_batches, training) not in self._plans:
            first, v, num_stages = self.model_chunks[0], len(self.model_chunks), self.num_stages
            if training:
                defer = first.defer_weight_grad
                every = plans(self.schedule, num_stages, micro_batches, first.checkpoint, defer, v, self.costs)
            else:
                every = evaluation(num_stages, micro_batches, v, self.schedule in V_SHAPED)
            check(every, training)
            self._plans[(micro_batches, training)] = every[self.stage]
        return self._plans[(micro_batches, training)]

    def forward(self, value: Value | None, head: Head | None = None) -> Value | None:
        """The plan up to its cut (``training_step``'s part): fill-drain's fill, or with a loss per micro-batch the
        whole plan; in evaluation every forward and send.

        Args:
            value: the backbone input of the whole mini-batch (used on the first stage only).
            head: on the last stage, for a plan with a loss per micro-batch, called at each ``loss`` action (see
                :data:`Head`).

        Returns:
            On the last stage, the backbone output of the whole mini-batch when the loss is on the whole mini-batch
            (fill-drain, evaluation); else ``None``.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            PipelineFailure: if another stage failed while this one waited for it.
        """
        plan = self._begin(value)
        self._run(plan, plan.cut, head)
        if plan.cut == len(plan.actions):
            self._plan = None
        if not self.is_last or plan.loss_per_micro_batch:
            return None
        last = len(self.model_chunks) - 1
        return self.model_chunks[-1].output([self._outputs.pop((last, i)) for i in range(self._micro_batches)])

    def backward(self) -> None:
        """The rest of the plan after the cut (fill-drain: the drain). On the last stage, the user's loss must have
        been backpropagated to the boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._plan is None:
            return
        if not sum(chunk.begin_backward() for chunk in self.model_chunks):  # one stage ran the step unsplit
            self.model_chunks[0].flush()
        else:
            self._run(self._plan, len(self._plan.actions))
        self._plan = None

    def _begin(self, value: Value | None) -> Plan:
        """Take the step's micro-batches (the first one is needed to know their number) and make the plan. The
        model chunks after the first take theirs when their first forward runs."""
        for chunk in self.model_chunks:
            chunk.receive_ahead = False  # until this step's plan says (its M comes with the first input)
        inputs = [chunk.inputs(value) for chunk in self.model_chunks]
        first = next(inputs[0], None)
        self._micro_batches = first[2] if first is not None else 0
        self._inputs = [_chain(first, inputs[0]), *inputs[1:]]
        self._outputs, self._done = {}, 0
        self._backward_begun = not self.model_chunks[0].training
        self._plan = self.plan(self._micro_batches, self.model_chunks[0].training)
        self.model_chunks[-1].loss_through = self._plan.backward_follows_loss
        for chunk in self.model_chunks:
            chunk.receive_ahead = self._plan.forwards_first
        return self._plan

    def _run(self, plan: Plan, end: int, head: Head | None = None) -> None:
        """Execute ``plan.actions`` from where the last call stopped up to ``end``, each recorded in the position."""
        position, total, number = self.position, len(plan.actions), self._done
        try:
            while number < end:
                action = plan.actions[number]
                if position is not None:
                    position.act(number + 1, total, action.kind.value, action.micro_batch, action.model_chunk)
                if not self._backward_begun and action.kind in _BACKPROPAGATING and action.micro_batch is not None:
                    self._backward_begun = True
                    if self.before_first_backward is not None:
                        self.before_first_backward()
                if action.kind is Kind.WEIGHT:  # W back to back run at once (one product per linear layer)
                    together = _weights_from(plan.actions, number, end)
                    self.model_chunks[action.model_chunk].backward_weights(together)
                    number += len(together)
                else:
                    self._execute(action, head)
                    number += 1
        finally:
            if position is not None:
                position.leave_plan()
        self._done = end

    def _execute(self, action: Action, head: Head | None) -> None:
        """Run one action on its model chunk (a flush: on every model chunk)."""
        kind, i, c = action.kind, action.micro_batch, action.model_chunk
        if kind is Kind.FLUSH:
            for each in self.model_chunks:
                each.flush()
            return
        if i is None:  # fill-drain's `loss`: the loss of the whole mini-batch runs between the plan's two parts
            return
        chunk = self.model_chunks[c]
        if kind is Kind.FORWARD:
            index, x, micro_batches = next(self._inputs[c])
            self._outputs[(c, index)] = chunk.forward(index, x, micro_batches)
        elif kind is Kind.SEND:
            chunk.send(self._outputs.pop((c, i)), i)
        elif kind is Kind.LOSS:
            assert head is not None  # a plan with a loss per micro-batch runs with a head (`forward`'s argument)
            chunk.loss(i, self._outputs.pop((c, i)), lambda y: head(i, self._micro_batches, y))
        elif kind is Kind.EXPECT:
            chunk.expect_grad(i)
        elif kind is Kind.RECOMPUTE:
            chunk.recompute(i)
        elif kind is Kind.BACKWARD:
            chunk.backward(i)


_BACKPROPAGATING = (Kind.LOSS, Kind.RECOMPUTE, Kind.BACKWARD, Kind.WEIGHT)
"""The kinds of action that may backpropagate through the stage (a loss of one micro-batch, under a plan with a loss
per micro-batch; fill-drain's loss of the whole mini-batch has no micro-batch and runs between the plan's parts)."""


def _weights_from(actions: tuple[Action, ...], start: int, end: int) -> list[int]:
    """The micro-batches of the W actions from ``actions[start]`` on, up to the first action of another kind or
    model chunk, or ``end``."""
    indices: list[int] = []
    for action in actions[start:end]:
        if action.kind is not Kind.WEIGHT or action.model_chunk != actions[start].model_chunk:
            break
        assert action.micro_batch is not None  # a W is of one micro-batch
        indices.append(action.micro_batch)
    return indices


def _chain(first: tuple[int, Value, int] | None, rest: Iterator) -> Iterator[tuple[int, Value, int]]:
    if first is not None:
        yield first
        yield from rest
