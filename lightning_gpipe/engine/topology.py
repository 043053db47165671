"""Where each stage lives: the one mapping between global ranks, pipeline ranks and data-parallel ranks.

The world is a 2-D mesh, data-parallel replicas x pipeline stages, built on torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` with the dimensions named ``("dp", "pp")``, so its
process groups are torch's. Every other module asks this one for ranks and groups.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.engine.actions import stage_of_virtual, virtual_stage

Size = int | Literal["auto"]
"""A mesh dimension's size as the strategy takes it: a positive integer, or ``"auto"``."""


@dataclass(frozen=True)
class Topology:
    """The (data-parallel x pipeline) mesh of one training run.

    Global rank ``r`` holds pipeline rank ``r % num_stages`` of data-parallel replica ``r // num_stages``
    (the ``"pp"`` dimension is the inner one), so the stages of one pipeline are neighbours in rank order:
    with one pipeline per node, on one node, where the heavy point-to-point traffic stays; the replicas'
    all-reduce, once per optimizer step, crosses nodes.

    With ``virtual_stages`` v > 1 the backbone is split into ``K * v`` virtual stages and pipeline rank k holds
    virtual stages k, k + K, k + 2K, ... (its model chunks 0, 1, 2, ...; Narayanan et al. 2021, section 2.2), or
    with ``v_shape`` virtual stages k and 2K - 1 - k (ZB-V's V, :func:`~lightning_gpipe.engine.actions.virtual_stage`).

    Args:
        world_size: number of processes in the job, ``num_nodes * devices``.
        num_stages: K, the number of pipeline stages (processes) of each replica.
        virtual_stages: v, the model chunks of each stage (default 1).
        v_shape: whether the two model chunks of each stage are placed in a V (default ``False``: looped).

    Raises:
        ValueError: if ``world_size`` is not a positive multiple of ``num_stages``, ``virtual_stages > 1`` with
            one stage (``v_shape``: with one stage, or other than two model chunks per stage).
    """

    world_size: int
    num_stages: int
    virtual_stages: int = 1
    v_shape: bool = False

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"{self.world_size} processes cannot hold pipelines of {self.num_stages} stages:"
                " the number of devices must be a multiple of the number of stages."
            )
        if self.v_shape and self.num_stages == 1:
            raise ValueError(
                "GPipeStrategy(schedule='zb-v') places two model chunks per stage in a V across the stages, but the"
                " pipeline has one stage; use more devices per pipeline, or another schedule."
            )
        if self.virtual_stages > 1 and self.num_stages == 1:
            raise ValueError(
                f"GPipeStrategy(virtual_stages={self.virtual_stages}) interleaves model chunks between stages, but the"
                " pipeline has one stage; use virtual_stages=1, or more devices per pipeline."
            )
        if self.v_shape and self.virtual_stages != 2:
            raise ValueError(f"A V places two model chunks per stage, not virtual_stages={self.virtual_stages}.")

    @property
    def num_virtual(self) -> int:
        """``K * v``: the virtual stages of a pipeline (K without virtual stages)."""
        return self.num_stages * self.virtual_stages

    def virtual_of(self, stage_index: int) -> list[int]:
        """The virtual stages pipeline rank ``stage_index`` holds, in model chunk order: ``k, k + K, ...`` (in a V:
        ``k, 2K - 1 - k``)."""
        return [virtual_stage(stage_index, c, self.num_stages, self.v_shape) for c in range(self.virtual_stages)]

    @property
    def last_stage(self) -> int:
        """The pipeline rank that holds the last virtual stage, and with it the modules after the backbone: K - 1,
        or 0 in a V."""
        return stage_of_virtual(self.num_virtual - 1, self.num_stages, self.v_shape)[0]

    def link_tag(self, virtual: int) -> int:
        """The point-to-point tag of the link between virtual stages ``virtual`` and ``virtual + 1``: 0 with one
        model chunk per stage, else one tag per link (2 on), since two links may join the same pair of ranks."""
        return 0 if self.virtual_stages == 1 else 2 + virtual

    def skip_tag(self, src: int, dst: int) -> int:
        """The tag of the skip connections from virtual stage ``src`` to ``dst``: 1 with one model chunk per stage, else
        one tag per pair, above every :meth:`link_tag`."""
        return 1 if self.virtual_stages == 1 else 2 + self.num_virtual * (1 + src) + dst

    @property
    def data_parallel_size(self) -> int:
        """Number of pipeline replicas."""
        return self.world_size // self.num_stages

    def stage_of(self, rank: int) -> int:
        """Pipeline rank (the stage index, 0-based) of global rank ``rank``."""
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        """Data-parallel rank of global rank ``rank``."""
        return rank // self.num_stages

    def rank_of(self, stage_index: int, replica: int) -> int:
        """Global rank holding stage ``stage_index`` of data-parallel replica ``replica``."""
        return replica * self.num_stages + stage_index

    def rank_of_virtual(self, virtual: int, replica: int) -> int:
        """Global rank holding virtual stage ``virtual`` of data-parallel replica ``replica`` (see the class
        docstring)."""
        return self.rank_of(stage_of_virtual(virtual, self.num_stages, self.v_shape)[0], replica)

    def name(self, rank: int) -> str:
        """How messages name global rank ``rank``: ``"stage 1"``, or ``"stage 1 of replica 0 (rank 1)"`` with
        several replicas."""
        stage = f"stage {self.stage_of(rank)}"
        return stage if self.data_parallel_size == 1 else f"{stage} of replica {self.replica_of(rank)} (rank {rank})"

    def mesh(self, device_type: str) -> DeviceMesh:
        """The ``("dp", "pp")`` device mesh of this topology (a collective call on every process of the job).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``: the type of the processes' devices.
        """
        return init_device_mesh(device_type, (self.data_parallel_size, self.num_stages), mesh_dim_names=("dp", "pp"))


def resolve_topology(
    pipeline_parallel_size: Size,
    data_parallel_size: Size,
    balance: Any,
    devices_per_node: int,
    num_nodes: int,
    virtual_stages: int = 1,
    v_shape: bool = False,
) -> Topology:
    """The mesh the strategy's arguments ask for, checked against the job's size.

    ``"auto"`` sizes follow Lightning's ``ModelParallelStrategy``: the pipeline takes the length of a list
    ``balance``, else the other size's quotient, else the devices of one node (each node holds one pipeline;
    the replicas are the nodes).

    Args:
        pipeline_parallel_size: K, the stages of each pipeline, or ``"auto"``.
        data_parallel_size: the pipeline replicas, or ``"auto"``.
        balance: the strategy's ``balance`` (a list fixes ``K * virtual_stages``).
        devices_per_node: processes per node (``devices``).
        num_nodes: nodes of the job.
        virtual_stages: model chunks per stage (default 1).
        v_shape: whether they are placed in a V (:class:`Topology`).

    Raises:
        ValueError: if a size is neither a positive integer nor ``"auto"``, if the sizes' product is not
            the world size ``devices * num_nodes``, if a list ``balance`` has another length than
            ``K * virtual_stages``, or for virtual stages on a one-stage pipeline.
    """
    world = devices_per_node * num_nodes
    pp = checked_size(pipeline_parallel_size, "pipeline_parallel_size")
    dp = checked_size(data_parallel_size, "data_parallel_size")
    stages_listed = _stages_listed(balance, virtual_stages)
    listed = stages_listed is not None
    if pp == "auto":
        quotient = world // dp if dp != "auto" and world % dp == 0 else devices_per_node
        pp = stages_listed if stages_listed is not None else quotient
    if listed and pipeline_parallel_size == "auto" and world % pp:
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}) gives pipelines of {pp} stages, which cannot fill the job's"
            f" {world} processes (devices={devices_per_node} x num_nodes={num_nodes}): the number of processes must"
            " be a multiple of the stages. Give one layer count per stage of one pipeline."
        )
    if dp == "auto":
        dp = max(world // pp, 1)
    if pp * dp != world:
        raise ValueError(
            f"GPipeStrategy(pipeline_parallel_size={pipeline_parallel_size!r},"
            f" data_parallel_size={data_parallel_size!r}) makes a mesh of {pp} stages x {dp} replicas = {pp * dp}"
            f" processes, but the job has {world} (devices={devices_per_node} x num_nodes={num_nodes}). Choose"
            " sizes whose product is devices * num_nodes, or leave them 'auto'."
        )
    if listed and len(balance) != pp * virtual_stages:
        per = "stage" if virtual_stages == 1 else f"virtual stage ({pp} stages x virtual_stages={virtual_stages})"
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}) gives {len(balance)} stages, but the pipeline has"
            f" {pp * virtual_stages} (pipeline_parallel_size={pipeline_parallel_size!r} of {world} processes). Give one"
            f" balance entry per {per}, or set pipeline_parallel_size to the length of balance."
        )
    return Topology(world_size=world, num_stages=pp, virtual_stages=virtual_stages, v_shape=v_shape)


def _stages_listed(balance: Any, virtual_stages: int) -> int | None:
    """The stages (processes) a list ``balance`` gives with ``virtual_stages`` model chunks each; ``None`` for a mode.

    Raises:
        ValueError: if the list's length is not a multiple of ``virtual_stages``.
    """
    if balance is None or isinstance(balance, str) or not isinstance(balance, Sequence):
        return None
    if len(balance) % virtual_stages:
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}, virtual_stages={virtual_stages}): give one layer count per"
            f" virtual stage, K * virtual_stages entries for K stages; {len(balance)} is not a multiple of"
            f" {virtual_stages}."
        )
    return len(balance) // virtual_stages


def checked_size(size: Any, name: str) -> Size:
    """``size`` if it is a positive integer or ``"auto"``.

    Raises:
        ValueError: otherwise, naming the strategy argument ``name``.
    """
    if size == "auto" or (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        return size
    raise ValueError(f"GPipeStrategy({name}={size!r}): give a positive integer or 'auto'.")


def groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's ``(pipeline group, data-parallel group)`` of ``mesh``: the stages of its replica, and the
    replicas of its stage."""
    return mesh.get_group("pp"), mesh.get_group("dp")
