"""Each model chunk's links to the virtual stages it talks to (:func:`wire`), and a process group of its own for every
point-to-point link that may share a pair of ranks with another link.

Gloo matches point-to-point messages by source and tag, so two links between the same pair of ranks (a stage's
neighbour link and a skip connection's, or two model chunks' links under virtual stages) stay apart by their tags
(:meth:`~lightning_gpipe.engine.topology.Topology.link_tag`,
:meth:`~lightning_gpipe.engine.topology.Topology.skip_tag`). NCCL
ignores tags: it matches the messages two ranks exchange in one communicator by their order, which
two links, each used in its own order, would mix or deadlock. So every such link gets a process group of its own
(on NCCL, a communicator of its own), on every backend, so that the path the tests run on gloo is the one NCCL
takes: under virtual stages every neighbour link, and every skip connection between two processes. The neighbour
links of a pipeline without virtual stages stay on the default group.
"""

from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_gpipe.engine.events import Recorder, TrackingRecorder
from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.skip.links import SkipLinks
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.engine.transfer import Link, Turn
from lightning_gpipe.faults import Job


class Spec(Protocol):
    """What the wiring reads of a :class:`~lightning_gpipe.engine.pipeline.StageSpec`."""

    @property
    def topology(self) -> Topology:
        """The mesh of processes."""

    @property
    def rank(self) -> int:
        """This process's global rank."""

    @property
    def device(self) -> torch.device:
        """The device of the links' transfers."""

    @property
    def control(self) -> dist.ProcessGroup | None:
        """The CPU process group of the links' control messages (``None``: each link's own group)."""

    @property
    def held(self) -> list[int]:
        """This process's virtual stages, in model chunk order."""


LinkKey = tuple[int, int, int]
"""A link of the job: ``(pipeline, sending virtual stage, receiving virtual stage)`` (:meth:`~lightning_gpipe.engine.
Topology.pipeline_of`)."""


def link_groups(topology: Topology, skips: SkipLayout, rank: int) -> dict[LinkKey, dist.ProcessGroup]:
    """Create the process groups of the links that get one (see the module docstring), and return those that
    ``rank`` is in, by link.

    A collective call on every process of the job, which all make with the same ``topology`` and ``skips``: each
    group is created by every process, in one order. A skip between two model chunks of one process gets none (it is
    refused where the links are made).
    """
    pairs = [(s, s + 1) for s in range(topology.num_virtual - 1)] if topology.virtual_stages > 1 else []
    pairs += sorted({(route.src, route.dst) for route in skips.routes})
    groups = {}
    for pipeline in range(topology.num_pipelines):
        for src, dst in pairs:
            ranks = sorted({topology.rank_of_virtual(src, pipeline), topology.rank_of_virtual(dst, pipeline)})
            if len(ranks) == 2:
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups[(pipeline, src, dst)] = group
    return groups


def wire(spec: Spec, skips: SkipLayout, job: Job) -> "_Wiring":
    """The wiring of this process's model chunks (:class:`_Wiring`; its ``links()`` makes them). A collective call:
    every process creates every link's process group (:func:`link_groups`)."""
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
        groups: the process groups of the links that have one, by link (:func:`link_groups`).
        turns: a :class:`~lightning_gpipe.engine.transfer.Turn` per route whose both ends are this process's, by
            ``("link" | "skip", sending virtual stage, receiving virtual stage)``.
    """

    def __init__(
        self, spec: Spec, skips: SkipLayout, job: Job, groups: dict[LinkKey, dist.ProcessGroup], turns: dict
    ) -> None:
        self.spec, self.skips, self.job, self.groups, self.turns = spec, skips, job, groups, turns
        self.pipeline = spec.topology.pipeline_of(spec.rank)
        self.place = partial(spec.topology.rank_of_virtual, pipeline=self.pipeline)

    def links(self) -> list[tuple[Link, SkipLinks | None]]:
        """Every model chunk's links, in model chunk order."""
        recorder = TrackingRecorder(self.job.position)
        return [
            self._model_chunk_links(virtual, recorder.for_model_chunk(c)) for c, virtual in enumerate(self.spec.held)
        ]

    def _model_chunk_links(self, virtual: int, events: Recorder) -> tuple[Link, SkipLinks | None]:
        """Virtual stage ``virtual``'s link and skip links (``None`` where its layers neither stash nor pop), both
        recording into ``events``."""
        skips = self._skips(virtual, events) if virtual in self.skips.stages else None
        return self._link(virtual, events), skips

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
        key: LinkKey = (self.pipeline, src, dst)
        return self.groups.get(key)
