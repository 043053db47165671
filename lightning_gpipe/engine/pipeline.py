"""The engine's front door: one process's part of a pipeline, built by one function from a small spec.

:func:`build_pipeline` turns a module, the name of its ``nn.Sequential`` backbone and a :class:`StageSpec` into a
:class:`StagePipeline`, a pipeline of values: the skips checked, batch norm deferred, the tied parameters found
(before the split, while each is one object), the module split into this process's model chunks and compiled where
asked, each model chunk's links to the virtual stages it talks to, a model chunk per virtual stage, the runtime over
them, and the tied parameters' process groups. What calls the engine (the Lightning adapter, a plain loop) then
drives a step through the pipeline alone, as torchgpipe's ``GPipe.forward`` drives its ``Pipeline``::

    pipeline = build_pipeline(module, "backbone", StageSpec(topology, rank, device, balance=[2, 2]), job)
    output = pipeline.forward(x)        # the plan up to its cut: the fill (the last stage gets the output)
    loss(output).backward()             # on the last stage: the gradient reaches the stage's boundary
    pipeline.backward()                 # the rest of the plan: the drain

Where the plan computes each micro-batch's loss during the step (1F1B, zero-bubble), :meth:`StagePipeline.forward`
takes a ``head`` that runs the loss of one micro-batch and runs the whole plan.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.engine.actions import ActionCost
from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm, revert_deferred_batch_norm
from lightning_gpipe.engine.channels import LinkKey, link_groups
from lightning_gpipe.engine.compilation import CompileOption, compile_layers, compile_options, uncompile_layers
from lightning_gpipe.engine.events import Recorder, TrackingRecorder
from lightning_gpipe.engine.microbatch import Value
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.partition import Partition, Split
from lightning_gpipe.engine.runtime import Head, Runtime
from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.skip.links import SkipLinks
from lightning_gpipe.engine.ties import TiedParameters, find_ties
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.engine.transfer import Link, Turn
from lightning_gpipe.faults.job import Job


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

    Build it with :func:`build_pipeline`. A training step is :meth:`forward` (the plan up to its cut), on the last
    stage the loss's backward to the stage's boundary, then :meth:`backward` (the rest of the plan); evaluation is
    :meth:`evaluate`. What must happen at a point of the step is registered as an event (:meth:`on_last_backward`),
    never set on the parts from outside.

    Args:
        split: the module split into this process's model chunks.
        model_chunks: one :class:`~lightning_gpipe.engine.model_chunk.ModelChunk` per virtual stage held.
        runtime: executes the process's plans over ``model_chunks``.
        ties: the parameters this process shares with other stages.
    """

    def __init__(self, split: Split, model_chunks: list[ModelChunk], runtime: Runtime, ties: TiedParameters) -> None:
        self.split, self.ties = split, ties
        self._chunks, self._runtime = model_chunks, runtime

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
        return self._chunks[-1].link.device

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
        return self._chunks[0].events

    def forward(self, value: Value | None, head: Head | None = None) -> Value | None:
        """Run the plan up to its cut: fill-drain's fill, or with a loss per micro-batch the whole plan.

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
        """Run the rest of the plan after its cut (fill-drain: the drain). On the last stage the loss must have been
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
        self._chunks[0].before_last_backward = callback

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
        first = self._chunks[0]
        return first.before_last_backward is None or not first.draining or first.loss_completes_gradients

    def close(self, whole: dict[str, Any] | None) -> None:
        """Undo the split (``whole``: every stage's state, on the process that gets the whole model back; see
        :meth:`~lightning_gpipe.engine.partition.Split.undo`), the compilation and deferred batch norm."""
        uncompile_layers(self.split.partition)
        self.split.undo(whole)
        revert_deferred_batch_norm(self.split.sequential)


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
    links = _wiring(spec, skips, job).links()
    options = (topology.num_virtual, spec.micro_batches, spec.checkpoint, spec.defer_weight_grad)
    chunks = [
        ModelChunk(partition, link, virtual, *options, skip_links)
        for partition, virtual, (link, skip_links) in zip(split.model_chunks, spec.held, links)
    ]
    runtime = Runtime(chunks, spec.schedule, topology.num_stages, job.position, spec.action_costs)
    ties = TiedParameters(tie_groups, module, topology, spec.rank, job)
    return StagePipeline(split, chunks, runtime, ties)


def _wiring(spec: StageSpec, skips: SkipLayout, job: Job) -> "_Wiring":
    """The wiring of this process's model chunks. A collective call: every process creates every link's process
    group (:mod:`~lightning_gpipe.engine.channels`)."""
    held = spec.held
    groups = link_groups(spec.topology, skips, spec.rank)
    routes = [("link", s, s + 1) for s in held] + [("skip", r.src, r.dst) for r in skips.routes]
    turns = {route: Turn() for route in routes if route[1] in held and route[2] in held}
    return _Wiring(spec, skips, job, groups, turns)


class _Wiring:
    """Each model chunk's :class:`~lightning_gpipe.engine.transfer.Link` to its neighbouring virtual stages and its
    :class:`~lightning_gpipe.engine.skip.links.SkipLinks` to the virtual stages its skips reach.

    Args:
        spec: the stage's spec.
        skips: the backbone's skip connections.
        job: the run's job (the links' waits).
        groups: the process groups of the links that have one, by link (:func:`~lightning_gpipe.engine.channels.
            link_groups`).
        turns: a :class:`~lightning_gpipe.engine.transfer.Turn` per route whose both ends are this process's, by
            ``("link" | "skip", sending virtual stage, receiving virtual stage)``.
    """

    def __init__(
        self, spec: StageSpec, skips: SkipLayout, job: Job, groups: dict[LinkKey, dist.ProcessGroup], turns: dict
    ) -> None:
        self.spec, self.skips, self.job, self.groups, self.turns = spec, skips, job, groups, turns
        self.replica = spec.topology.replica_of(spec.rank)
        self.place = partial(spec.topology.rank_of_virtual, replica=self.replica)

    def links(self) -> list[tuple[Link, SkipLinks]]:
        """Every model chunk's links, in model chunk order."""
        recorder = TrackingRecorder(self.job.position)
        return [self._chunk_links(virtual, recorder.for_chunk(c)) for c, virtual in enumerate(self.spec.held)]

    def _chunk_links(self, virtual: int, events: Recorder) -> tuple[Link, SkipLinks]:
        """Virtual stage ``virtual``'s link and skip links, both recording into ``events``."""
        return self._link(virtual, events), self._skips(virtual, events)

    def _link(self, virtual: int, events: Recorder) -> Link:
        """Virtual stage ``virtual``'s link to the virtual stages before and after it."""
        topology, place, last = self.spec.topology, self.place, self.spec.topology.num_virtual - 1
        return Link(
            prev_rank=place(virtual - 1) if virtual > 0 else None,
            next_rank=place(virtual + 1) if virtual < last else None,
            device=self.spec.device,
            events=events,
            tag=(topology.link_tag(virtual - 1), topology.link_tag(virtual)),
            job=self.job,
            groups=(self._group(virtual - 1, virtual), self._group(virtual, virtual + 1)),
            turns=(self.turns.get(("link", virtual - 1, virtual)), self.turns.get(("link", virtual, virtual + 1))),
            control=self.spec.control,
        )

    def _skips(self, virtual: int, events: Recorder) -> SkipLinks:
        """Virtual stage ``virtual``'s links to the virtual stages its skip connections reach."""
        peers: dict[str, dict] = {"outgoing": {}, "incoming": {}}
        groups, turns = {}, {}
        for direction, ends in (("outgoing", self.skips.outgoing(virtual)), ("incoming", self.skips.incoming(virtual))):
            for other, keys in ends.items():
                src, dst = (virtual, other) if direction == "outgoing" else (other, virtual)
                peer = (self.place(other), self.spec.topology.skip_tag(src, dst))
                peers[direction][peer] = keys
                groups[peer] = self._group(src, dst)
                if ("skip", src, dst) in self.turns:
                    turns[peer] = self.turns[("skip", src, dst)]
        return SkipLinks(
            **peers, device=self.spec.device, events=events, job=self.job, groups=groups, turns=turns,
            control=self.spec.control,
        )  # fmt: skip

    def _group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The process group of the link from virtual stage ``src`` to ``dst`` (``None``: the default group)."""
        key: LinkKey = (self.replica, src, dst)
        return self.groups.get(key)
