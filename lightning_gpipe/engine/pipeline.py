"""The engine's front door: one process's part of a pipeline, built by one function from a small spec.

:func:`build_pipeline` turns a module, the name of its ``nn.Sequential`` backbone and a :class:`StageSpec` into a
:class:`StagePipeline`, a pipeline of values: the skips checked, batch norm deferred, the tied parameters found
(before the split, while each is one object), the module split into this process's model chunks and compiled where
asked, each model chunk's links to the virtual stages it talks to, a model chunk per virtual stage, the runtime over
them, and the tied parameters' process groups. What calls the engine (the Lightning adapter, a plain loop) then
drives a step through the pipeline alone, as torchgpipe's ``GPipe.forward`` drives its ``Pipeline``::

    pipeline = build_pipeline(module, "backbone", StageSpec(topology, rank, device, balance=[2, 2]), job)
    output = pipeline.forward(x)        # the plan's forward phase: the fill (the last stage gets the output)
    loss(output).backward()             # on the last stage: the gradient reaches the stage's boundary
    pipeline.backward()                 # the plan's backward phase: the drain

Where the plan computes each micro-batch's loss during the step (1F1B, zero-bubble), :meth:`StagePipeline.forward`
takes a ``head`` that runs the loss of one micro-batch and runs the whole plan.

Behind the door, one :class:`Runtime` executes a process's plan (:mod:`lightning_gpipe.engine.schedule`) over its
model chunks. A plan is made for the step's number of micro-batches M, which a process learns as its first model
chunk takes its inputs (the first stage scatters the backbone input; the others learn M from the previous stage).
With several model chunks per process (``virtual_stages``), each is a
:class:`~lightning_gpipe.engine.model_chunk.ModelChunk`, a virtual stage of the pipeline of ``K * v``, and an action
runs on the model chunk it names.

A step's two phases split the plan where its backward phase begins
(:attr:`Plan.backward_from <lightning_gpipe.engine.actions.Plan.backward_from>`): :meth:`Runtime.forward` runs the
actions before it, :meth:`Runtime.backward` the rest. Under fill-drain the backward phase begins after the fill and
the user's loss runs on the whole mini-batch between the two; a schedule whose last stage needs each micro-batch's
loss during the step (1F1B, zero-bubble) runs its whole plan in the forward phase, and its ``loss`` actions call a
head per micro-batch; where each micro-batch's
backward follows its loss at once, the loss backpropagates through the last stage in the same autograd call
(:attr:`ModelChunk.loss_through <lightning_gpipe.engine.model_chunk.ModelChunk.loss_through>`). Evaluation runs the
forwards and sends of fill-drain's fill (whatever the schedule), then waits for the sends. W actions that follow each
other run as one call (:meth:`ModelChunk.backward_weights
<lightning_gpipe.engine.model_chunk.ModelChunk.backward_weights>`), which computes each plain linear layer's weight
gradient over their micro-batches as one matrix product.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine.actions import Action, ActionCost, Kind, Plan
from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm, revert_deferred_batch_norm
from lightning_gpipe.engine.channels import wire
from lightning_gpipe.engine.compilation import CompileOption, compile_layers, compile_options, uncompile_layers
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.microbatch import Partition, Value
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.offload import ActivationOffload, Placement, placement
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.schedule import V_SHAPED, check, evaluation, plans
from lightning_gpipe.engine.schedule_csv import ScheduleTable, is_schedule_file, read_schedule
from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.ties import TiedParameters, find_ties
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.faults import Job, Position


@dataclass(frozen=True)
class StageSpec:
    """What one process's part of a pipeline is made of.

    Args:
        topology: the mesh of processes (pipeline stages x data-parallel replicas, virtual stages).
        rank: this process's global rank in ``topology``.
        device: the device the stage's layers and transfers use.
        balance: backbone layers per virtual stage (``topology.num_virtual`` positive integers summing to the
            backbone's length).
        schedule: a name of :data:`lightning_gpipe.engine.schedule.SCHEDULES` (default ``"gpipe"``, fill-drain).
        micro_batches: M, the micro-batches a step's batch is split into (default 1; fewer when a batch has fewer
            rows).
        checkpoint: re-materialization, ``"always"``, ``"except_last"`` (default) or ``"never"``.
        defer_weight_grad: split each backward into the input gradient (B) and the weight gradient (W), run where
            the schedule places it (zero-bubble pipelines, Qi et al. 2023). Default ``False``.
        compile: ``torch.compile`` for each layer: ``False`` (default), ``True`` or its keyword arguments.
        deferred_batch_norm: normalise batch norm layers with micro-batch statistics and update their running
            statistics once per mini-batch (torchgpipe's deferred batch norm). Default ``False``.
        action_costs: one :class:`~lightning_gpipe.engine.actions.ActionCost` per virtual stage, for a schedule that
            places its actions by cost (``"zb-1p"``, ``"zb-v"``); ``None`` (default): equal costs.
        control: the CPU (gloo) process group of the links' control messages where the links' own groups are not
            gloo (NCCL); ``None`` (default): the links' own groups.
        offload: ``"activations"`` moves what each micro-batch's forward saves for its backward to host memory until
            a prefetch the plan places (:mod:`~lightning_gpipe.engine.offload`); ``None`` (default): no offload.
    """

    topology: Topology
    rank: int
    device: torch.device
    balance: Sequence[int]
    schedule: str = "gpipe"
    micro_batches: int = 1
    checkpoint: str = "except_last"
    defer_weight_grad: bool = False
    compile: CompileOption = False
    deferred_batch_norm: bool = False
    action_costs: Sequence[ActionCost] | None = None
    control: dist.ProcessGroup | None = None
    offload: str | None = None

    @property
    def stage(self) -> int:
        """This process's pipeline rank."""
        return self.topology.stage_of(self.rank)

    @property
    def held(self) -> list[int]:
        """This process's virtual stages, in model chunk order."""
        return list(self.topology.virtual_of(self.stage))


class StagePipeline:
    """One process's part of a pipeline: its model chunks and the runtime that executes its plan of each step.

    Build it with :func:`build_pipeline`. A training step is :meth:`forward` (the plan's forward phase), on the last
    stage the loss's backward to the stage's boundary, then :meth:`backward` (its backward phase); evaluation is
    :meth:`evaluate`. What must happen at a point of the step is registered as an event (:meth:`on_last_backward`),
    never set on the parts from outside.

    Args:
        split: the module split into this process's model chunks.
        model_chunks: one :class:`~lightning_gpipe.engine.model_chunk.ModelChunk` per virtual stage held.
        runtime: executes the process's plans over ``model_chunks``.
        ties: the parameters this process shares with other stages.
        process_groups: the process groups made for it that this process is in (its links' and its ties'): what
            :meth:`close` gives back.
    """

    def __init__(
        self,
        split: Split,
        model_chunks: list[ModelChunk],
        runtime: "Runtime",
        ties: TiedParameters,
        process_groups: list[dist.ProcessGroup],
    ) -> None:
        self.split, self.ties = split, ties
        self._model_chunks, self._runtime = model_chunks, runtime
        self._process_groups = process_groups

    @property
    def num_stages(self) -> int:
        """K, the processes of the pipeline."""
        return self._runtime.num_stages

    @property
    def stage(self) -> int:
        """This process's pipeline rank."""
        return self._runtime.stage

    @property
    def is_last(self) -> bool:
        """Whether this process runs the pipeline's last (virtual) stage, where the loss follows the backbone."""
        return self._runtime.is_last

    @property
    def device(self) -> torch.device:
        """The device of the stage's layers and transfers."""
        return self._model_chunks[-1].link.device

    @property
    def loss_per_micro_batch(self) -> bool:
        """Whether the plan computes each micro-batch's loss during the step (1F1B, zero-bubble): then
        :meth:`forward` takes a ``head`` and runs the whole plan, and :meth:`backward` has nothing left to do."""
        return self._runtime.loss_per_micro_batch

    @property
    def partition(self) -> Partition:
        """Every backbone layer this process holds, under its original names (all its model chunks')."""
        return self.split.partition

    @property
    def partitions(self) -> list[Partition]:
        """Each model chunk's backbone layers, in model chunk order (``[partition]`` with one per stage)."""
        return self.split.model_chunks

    @property
    def events(self) -> Recorder:
        """The process's recorder of timed spans (forwards, backwards, transfers), marked with their model chunk."""
        return self._model_chunks[0].events

    def forward(self, value: Value | None, head: "Head | None" = None) -> Value | None:
        """Run the plan's forward phase: fill-drain's fill, or with a loss per micro-batch the whole plan.

        Args:
            value: the backbone input of the whole mini-batch (a Tensor or tuple, rows in dim 0); read on the first
                stage only.
            head: on the last stage, for a plan with a loss per micro-batch: ``head(index, micro_batches, output)``
                computes micro-batch ``index``'s loss from its backbone output and backpropagates it.

        Returns:
            On the last stage, the backbone output of the whole mini-batch where the loss runs on the whole
            mini-batch; else ``None``.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (first stage).
            ScheduleError: if the plans could not run to their end, before any of their actions runs.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        return self._runtime.forward(value, head)

    def backward(self) -> None:
        """Run the plan's backward phase (fill-drain: the drain). On the last stage the loss must have been
        backpropagated to the stage's boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        self._runtime.backward()

    def evaluate(self, value: Value | None) -> Value | None:
        """The pipelined forward of ``value`` without gradients (every forward and send, then a flush); the
        backbone output of the whole mini-batch on the last stage, ``None`` elsewhere.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        with torch.no_grad():
            return self._runtime.forward(value)

    def on_last_backward(self, callback: Callable[[list[Tensor]], None]) -> None:
        """Call ``callback`` with the outputs of each step's last backward on this process, right before the
        autograd call that completes the stage's parameter gradients (the weight gradient W when deferred): where a
        data-parallel gradient sync starts. Where that call is the loss's own (see :attr:`loss_ends_backward`), the
        caller calls it."""
        self._model_chunks[0].before_last_backward = callback

    def on_backward_start(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once per training step, right before this process's first action that backpropagates
        through its layers (a recompute, a backward, a weight gradient, or under a plan with a loss per micro-batch, a
        micro-batch's loss): where a sharded data-parallel stage keeps its gathered parameters until the step's end.
        Under fill-drain the last stage's loss backpropagates to the stage's boundary before it, not through it."""
        self._runtime.before_first_backward = callback

    @property
    def loss_ends_backward(self) -> bool:
        """On the last stage, whether the step's last backward on this process is the loss's own autograd call:
        no :meth:`on_last_backward` callback is registered, a one-stage pipeline ran the step unsplit, or the last
        micro-batch's loss backpropagates through the stage."""
        first = self._model_chunks[0]
        return first.before_last_backward is None or not first.draining or first.loss_completes_gradients

    def close(self, whole: dict[str, Any] | None, release_groups: bool) -> None:
        """Undo the split (``whole``: every stage's state, on the process that gets the whole model back; see
        :meth:`~lightning_gpipe.engine.partition.Split.undo`), the compilation and deferred batch norm; with
        ``release_groups``, destroy the process groups made for the pipeline (each gloo group keeps threads that
        wake a hundred times a second until it is destroyed). Release them only once no process of the job uses
        them any more (after a barrier of the job, at the end of a run that completed)."""
        uncompile_layers(self.split.partition)
        self.split.undo(whole)
        revert_deferred_batch_norm(self.split.sequential)
        if release_groups:
            for group in self._process_groups:
                dist.destroy_process_group(group)
            self._process_groups = []


def build_pipeline(module: nn.Module, backbone: str, spec: StageSpec, job: Job) -> StagePipeline:
    """This process's part of the pipeline of ``module``'s backbone (see the module docstring).

    A collective call: every process of the job calls it, in the same order as its other collectives (it creates
    every link's and every tie's process group).

    Args:
        module: the whole module (or one created on the meta device); split in place.
        backbone: the name of its ``nn.Sequential`` attribute.
        spec: what the stage is made of.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (the links' waits, the ties' collectives).

    Raises:
        ValueError: if ``spec.balance`` does not fit the backbone, or the skip connections do not pair up.
    """
    layers, topology = getattr(module, backbone), spec.topology
    skips = SkipLayout(layers, spec.balance)  # checks the stash/pop pairs on every process alike
    if spec.deferred_batch_norm:
        convert_deferred_batch_norm(layers)  # the whole backbone, so that `Split.undo` puts it back
    tie_groups = find_ties(module, backbone, spec.balance, topology.num_stages, topology.v_shape)
    split = Split(module, backbone, spec.balance, spec.stage, topology.num_stages, spec.held)
    compile_layers(split.partition, compile_options(spec.compile), spec.defer_weight_grad)
    wiring = wire(spec, skips, job)
    links = wiring.links()
    options = (topology.num_virtual, spec.micro_batches, spec.checkpoint, spec.defer_weight_grad)
    model_chunks = [
        ModelChunk(partition, link, virtual, *options, skip_links, _offload(spec))
        for partition, virtual, (link, skip_links) in zip(split.model_chunks, spec.held, links)
    ]
    runtime = Runtime(model_chunks, spec.schedule, topology.num_stages, job.position, spec.action_costs)
    ties = TiedParameters(tie_groups, module, topology, spec.rank, job)
    return StagePipeline(split, model_chunks, runtime, ties, [*wiring.groups.values(), *ties.process_groups])


def _offload(spec: StageSpec) -> ActivationOffload | None:
    """A model chunk's activation offload, where ``spec`` asks for it."""
    return ActivationOffload(spec.device) if spec.offload == "activations" else None


Head = Callable[[int, int, Value], None]
"""The rest of the user's step on one micro-batch, on the last stage: ``head(index, micro_batches, output)`` computes
the micro-batch's loss from its backbone output and backpropagates it to the output (the stage's boundary)."""


class Runtime:
    """Runs one process's plan of each step, in the order the schedule gives.

    Args:
        model_chunks: the process's model chunks, in order: one :class:`ModelChunk` (virtual stage k of K), or with v
            per process those of virtual stages k, k + K, ... of ``K * v`` (or as a V places them).
        schedule: a name of :data:`lightning_gpipe.engine.schedule.SCHEDULES`, or the path of a CSV schedule in
            torch.distributed.pipelining's format (:mod:`~lightning_gpipe.engine.schedule_csv`).
        num_stages: K, the processes of the pipeline.
        position: the process's position (its run's :attr:`lightning_gpipe.faults.job.Job.position`), which records
            the action being executed (number, kind, micro-batch, model chunk) for the stall watchdog; none by default.
        costs: one :class:`~lightning_gpipe.engine.actions.ActionCost` per virtual stage, for a schedule that places
            its actions by cost (``"zb-1p"``, ``"zb-v"``); ``None`` (default): equal costs.

    Attributes:
        stage: the process's pipeline rank.
        loss_per_micro_batch: whether the plans call a head per micro-batch (their backward phase is empty).
        before_first_backward: called once per training step, right before the process's first action that
            backpropagates through it (a recompute, a backward, a weight gradient, or a micro-batch's loss); set
            through :meth:`~lightning_gpipe.engine.StagePipeline.on_backward_start`. ``None`` (default): nothing.

    Raises:
        ValueError: for an unknown schedule, or a CSV schedule written for another K, M or v.
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
        self._table: ScheduleTable | None = read_schedule(schedule) if is_schedule_file(schedule) else None
        if self._table is not None:
            self._table.fit(num_stages, model_chunks[0].micro_batches, len(model_chunks))
        self._plans: dict[tuple[int, bool], Plan] = {}  # by (number of micro-batches, training)
        self.loss_per_micro_batch = self.plan(1).loss_per_micro_batch
        self._plan: Plan | None = None
        self._offloads = _NO_OFFLOAD  # the step's plan's offloads and prefetches (_begin)
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
                if self._table is not None:  # a CSV of first.micro_batches; a smaller batch runs its first ones
                    every = self._table.plans(first.checkpoint, defer, micro_batches)
                else:
                    every = plans(self.schedule, num_stages, micro_batches, first.checkpoint, defer, v, self.costs)
            else:
                v_shape = self.schedule in V_SHAPED or (self._table is not None and self._table.v_shape)
                every = evaluation(num_stages, micro_batches, v, v_shape)
            check(every, training)
            self._plans[(micro_batches, training)] = every[self.stage]
        return self._plans[(micro_batches, training)]

    def forward(self, value: Value | None, head: Head | None = None) -> Value | None:
        """The plan's forward phase, up to :attr:`Plan.backward_from`: fill-drain's fill, or with a loss per
        micro-batch the whole plan; in evaluation every forward and send.

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
        self._run(plan, plan.backward_from, head)
        if plan.backward_from == len(plan.actions):
            self._plan = None
        if not self.is_last or plan.loss_per_micro_batch:
            return None
        last = len(self.model_chunks) - 1
        return self.model_chunks[-1].output([self._outputs.pop((last, i)) for i in range(self._micro_batches)])

    def backward(self) -> None:
        """The plan's backward phase, from :attr:`Plan.backward_from` (fill-drain: the drain). On the last stage, the
        user's loss must have been backpropagated to the boundary first.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._plan is None:
            return
        if not sum(model_chunk.begin_backward() for model_chunk in self.model_chunks):  # one stage ran the step unsplit
            self.model_chunks[0].flush()
        else:
            self._run(self._plan, len(self._plan.actions))
        self._plan = None

    def _begin(self, value: Value | None) -> Plan:
        """Take the step's micro-batches (the first one is needed to know their number) and make the plan. The
        model chunks after the first take theirs when their first forward runs."""
        for model_chunk in self.model_chunks:
            model_chunk.receive_ahead = False  # until this step's plan says (its M comes with the first input)
        inputs = [model_chunk.inputs(value) for model_chunk in self.model_chunks]
        first = next(inputs[0], None)
        self._micro_batches = first[2] if first is not None else 0
        self._inputs = [_chain(first, inputs[0]), *inputs[1:]]
        self._outputs, self._done = {}, 0
        self._backward_begun = not self.model_chunks[0].training
        self._plan = self.plan(self._micro_batches, self.model_chunks[0].training)
        self.model_chunks[-1].loss_through = self._plan.backward_follows_loss
        self._offloads = self._placement(self._plan)  # once per step: every _run of the plan reads it
        for c, model_chunk in enumerate(self.model_chunks):
            model_chunk.receive_ahead = self._plan.forwards_first
            if model_chunk.offload is not None:
                model_chunk.offload.begin_step(frozenset(i for chunk, i in self._offloads.offloaded if chunk == c))
        return self._plan

    def _run(self, plan: Plan, end: int, head: Head | None = None) -> None:
        """Execute ``plan.actions`` from where the last call stopped up to ``end``, each recorded in the position."""
        position, total, number = self.position, len(plan.actions), self._done
        prefetches = self._offloads.prefetch
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
                    self._prefetch(prefetches, range(number, number + len(together)))
                    self.model_chunks[action.model_chunk].backward_weights(together)
                    number += len(together)
                else:
                    self._prefetch(prefetches, [number])
                    self._execute(action, head)
                    number += 1
        finally:
            if position is not None:
                position.leave_plan()
        self._done = end

    def _placement(self, plan: Plan) -> Placement:
        """Where ``plan``'s offloads and prefetches go (none without offload)."""
        return placement(plan) if self.model_chunks[0].offload is not None else _NO_OFFLOAD

    def _prefetch(self, prefetches: dict[int, tuple[tuple[int, int], ...]], numbers: Sequence[int]) -> None:
        """Start the copies back the plan places before its actions ``numbers``, before they compute."""
        for number in numbers:
            for c, i in prefetches.get(number, ()):
                offload = self.model_chunks[c].offload
                assert offload is not None  # a plan's offloads are placed only where its model chunks offload
                offload.prefetch(i)

    def _execute(self, action: Action, head: Head | None) -> None:
        """Run one action on its model chunk (a flush: on every model chunk)."""
        kind, i, c = action.kind, action.micro_batch, action.model_chunk
        if kind is Kind.FLUSH:
            for each in self.model_chunks:
                each.flush()
            return
        if i is None:  # fill-drain's `loss`: the loss of the whole mini-batch runs between the plan's two parts
            return
        model_chunk = self.model_chunks[c]
        if kind is Kind.FORWARD:
            index, x, micro_batches = next(self._inputs[c])
            self._outputs[(c, index)] = model_chunk.forward(index, x, micro_batches)
        elif kind is Kind.SEND:
            model_chunk.send(self._outputs.pop((c, i)), i)
        elif kind is Kind.LOSS:
            assert head is not None  # a plan with a loss per micro-batch runs with a head (`forward`'s argument)
            model_chunk.loss(i, self._outputs.pop((c, i)), lambda y: head(i, self._micro_batches, y))
        elif kind is Kind.EXPECT:
            model_chunk.expect_grad(i)
        elif kind is Kind.RECOMPUTE:
            model_chunk.recompute(i)
        elif kind is Kind.BACKWARD:
            model_chunk.backward(i)


_NO_OFFLOAD = Placement(frozenset(), {})


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
