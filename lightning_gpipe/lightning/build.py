"""Building this process's stage at setup: a small builder whose steps run in order.

:func:`build_stage` runs :class:`StageBuilder`'s steps:

1. :meth:`~StageBuilder.split`: the balance (from the planner's solver where a mode or limit chooses it), the skip
   connections checked, deferred batch norm, the tied parameters found (before the split, while each is one
   object), the module split into this stage's model chunks (:class:`~lightning_gpipe.engine.partition.Split`),
   and compiled where asked;
2. :meth:`~StageBuilder.links`: each model chunk's :class:`~lightning_gpipe.engine.transfer.Link` to its
   neighbouring virtual stages and its :class:`~lightning_gpipe.engine.skip.links.SkipLinks` to the virtual stages
   its skips reach (a :class:`~lightning_gpipe.engine.transfer.Turn` where both ends are this process's);
3. :meth:`~StageBuilder.runtime`: a :class:`~lightning_gpipe.engine.model_chunk.ModelChunk` per model chunk and
   the :class:`~lightning_gpipe.engine.runtime.Runtime` over them, with the actions' costs for a schedule placed by
   cost (modelled by the planner here: the engine never calls it);
4. :meth:`~StageBuilder.ties`: the tied parameters' process groups.

The strategy then holds the :class:`~lightning_gpipe.lightning.run.StageRun` it returns.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm
from lightning_gpipe.engine.channels import LinkKey, link_groups
from lightning_gpipe.engine.compilation import compile_layers, compile_options
from lightning_gpipe.engine.contract import BackboneCall
from lightning_gpipe.engine.events import TrackingRecorder
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.runtime import Runtime
from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.skip.links import SkipLinks
from lightning_gpipe.engine.ties import TiedParameters, find_ties
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.engine.transfer import Link, Turn
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.randomness import StageRandomness
from lightning_gpipe.lightning.relay import LogRelay, StepRelay
from lightning_gpipe.lightning.run import StageRun
from lightning_gpipe.planning.balance import LayerCost, resolve_balance
from lightning_gpipe.planning.costs import CostModel
from lightning_gpipe.planning.predict import modelled_stage_costs
from lightning_gpipe.planning.simulator import action_costs

Route = tuple[str, int, int]
"""A transfer route of the pipeline: ``("link" | "skip", sending virtual stage, receiving virtual stage)``."""


class StageBuilder:
    """The steps that build one process's stage (see the module docstring), each a method, run in order.

    Args:
        module: the LightningModule, whole (or created on the meta device).
        name: the attribute of its ``nn.Sequential`` backbone.
        config: the strategy's options.
        topology: the mesh; ``rank`` is this process's global rank in it.
        rank: this process's global rank.
        device: the stage's device.
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (the links' waits, the ties' collectives).
        control: the CPU (gloo) process group of the links' control messages on a job whose links are not gloo
            (NCCL); ``None`` (default): the links' own groups.
    """

    def __init__(
        self,
        module: "pl.LightningModule",
        name: str,
        config: PipelineConfig,
        topology: Topology,
        rank: int,
        device: torch.device,
        job: Job,
        control: dist.ProcessGroup | None = None,
    ) -> None:
        self.module, self.name, self.config, self.topology = module, name, config, topology
        self.rank, self.device, self.job, self.control = rank, device, job, control
        self.stage, self.replica = topology.stage_of(rank), topology.replica_of(rank)
        self.held = topology.virtual_of(self.stage)  # this process's virtual stages, in model chunk order

    def split(self, costs: list[LayerCost] | None) -> Split:
        """Choose the balance (``costs``: the backbone layers' profiled costs, where the balance needs them), check
        the skips, find the ties, and split the module into this stage's model chunks.

        Raises:
            ValueError: if ``balance`` does not fit the backbone, or the skip connections do not pair up.
        """
        config, topology, layers = self.config, self.topology, getattr(self.module, self.name)
        limit, v = config.balance_memory_limit, topology.virtual_stages
        self.balance = resolve_balance(config.balance, layers, topology.num_virtual, costs, limit, v)
        self.skips = SkipLayout(layers, self.balance)  # checks the stash/pop pairs on every stage alike
        if config.deferred_batch_norm:
            convert_deferred_batch_norm(layers)  # the whole backbone, so that `Split.undo` puts it back
        self.tie_groups = find_ties(self.module, self.name, self.balance, topology.num_stages, topology.v_shape)
        self.split_module = Split(self.module, self.name, self.balance, self.stage, topology.num_stages, self.held)
        compile_layers(self.split_module.partition, compile_options(config.compile), config.splits_backward)
        return self.split_module

    def links(self) -> list[tuple[Link, SkipLinks]]:
        """Each model chunk's link to its neighbouring virtual stages and to those its skips reach. A collective
        call: every process creates every link's process group (:mod:`~lightning_gpipe.engine.channels`)."""
        self.groups = link_groups(self.topology, self.skips, self.rank)
        routes = [("link", s, s + 1) for s in self.held] + [("skip", r.src, r.dst) for r in self.skips.routes]
        self.turns = {route: Turn() for route in routes if route[1] in self.held and route[2] in self.held}
        self.recorder = TrackingRecorder(self.job.position)
        return [self._links(virtual, self.recorder.for_chunk(c)) for c, virtual in enumerate(self.held)]

    def runtime(self, links: list[tuple[Link, SkipLinks]], costs: list[LayerCost] | None) -> Runtime:
        """A :class:`ModelChunk` per model chunk over its ``links``, and the runtime that runs the stage's plans
        (with the actions' modelled costs where the schedule is placed by cost)."""
        config, num_virtual = self.config, self.topology.num_virtual
        micro_batches = config.micro_batches_for(self.topology.num_stages)
        options = (micro_batches, config.checkpoint, config.splits_backward)
        self.model_chunks = [
            ModelChunk(partition, link, virtual, num_virtual, *options, skip_links)
            for partition, virtual, (link, skip_links) in zip(self.split_module.model_chunks, self.held, links)
        ]
        placed = None
        if config.placed_by_cost:
            placed = action_costs(modelled_stage_costs(costs, self.balance, CostModel(), split=True))
        return Runtime(self.model_chunks, config.schedule, self.topology.num_stages, self.job.position, placed)

    def ties(self) -> TiedParameters:
        """The parameters this stage shares with others (a collective call: one process group per tie)."""
        return TiedParameters(self.tie_groups, self.module, self.topology, self.rank, self.job)

    def _links(self, virtual: int, events: TrackingRecorder) -> tuple[Link, SkipLinks]:
        """Virtual stage ``virtual``'s link to its neighbours and its skip links."""
        topology, replica, last = self.topology, self.replica, self.topology.num_virtual - 1
        place = partial(topology.rank_of_virtual, replica=replica)
        link = Link(
            prev_rank=place(virtual - 1) if virtual > 0 else None,
            next_rank=place(virtual + 1) if virtual < last else None,
            device=self.device,
            events=events,
            tag=(topology.link_tag(virtual - 1), topology.link_tag(virtual)),
            job=self.job,
            groups=(self._group(virtual - 1, virtual), self._group(virtual, virtual + 1)),
            turns=(self.turns.get(("link", virtual - 1, virtual)), self.turns.get(("link", virtual, virtual + 1))),
            control=self.control,
        )
        outgoing, incoming = self.skips.outgoing(virtual), self.skips.incoming(virtual)
        peers: dict[str, dict] = {"outgoing": {}, "incoming": {}}
        groups, turns = {}, {}
        for direction, ends in (("outgoing", outgoing), ("incoming", incoming)):
            for other, keys in ends.items():
                src, dst = (virtual, other) if direction == "outgoing" else (other, virtual)
                peer = (place(other), topology.skip_tag(src, dst))
                peers[direction][peer] = keys
                groups[peer] = self._group(src, dst)
                if ("skip", src, dst) in self.turns:
                    turns[peer] = self.turns[("skip", src, dst)]
        skip_links = SkipLinks(**peers, device=self.device, events=events, job=self.job, groups=groups, turns=turns,
                               control=self.control)  # fmt: skip
        return link, skip_links

    def _group(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The process group of the link from virtual stage ``src`` to ``dst`` (``None``: the default group)."""
        key: LinkKey = (self.replica, src, dst)
        return self.groups.get(key)


def build_stage(
    builder: StageBuilder,
    costs: list[LayerCost] | None,
    randomness: StageRandomness,
    share: Callable[[Any], Any],
    relays: tuple[LogRelay, StepRelay],
) -> StageRun:
    """Run ``builder``'s steps and return this process's :class:`~lightning_gpipe.lightning.run.StageRun` (then call
    its :meth:`~lightning_gpipe.lightning.run.StageRun.start`).

    Args:
        builder: the builder of this process's stage.
        costs: the backbone layers' profiled costs, where the balance or the schedule needs them.
        randomness: the stage's random streams (see :mod:`lightning_gpipe.lightning.randomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        relays: the logging relays of this process's pipeline: after evaluation steps and epoch-end hooks, and
            in training steps.

    Raises:
        ValueError: if ``balance`` does not fit the backbone, or the skip connections do not pair up.
    """
    split = builder.split(costs)
    runtime = builder.runtime(builder.links(), costs)
    position = builder.job.position
    backbone_call = BackboneCall(runtime, runtime.is_last, share=share, randomness=randomness, position=position)
    split.partition.backbone_call = backbone_call
    ties = builder.ties()
    chunks = builder.model_chunks
    relay, step_relay = relays
    return StageRun(split, chunks, runtime, backbone_call, relay, step_relay, ties, randomness, share, builder.job)
