"""Where each stage lives: the one mapping between global ranks, pipeline ranks and data-parallel ranks.

The world is a 2-D mesh, data-parallel replicas x pipeline stages, built on torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` with the dimensions named ``("dp", "pp")``, so its
process groups are torch's. Every other module asks this one for ranks and groups.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

Size = Union[int, str]
"""A mesh dimension's size as the strategy takes it: a positive integer, or ``"auto"``."""


@dataclass(frozen=True)
class Topology:
    """The (data-parallel x pipeline) mesh of one training run.

    Global rank ``r`` holds pipeline rank ``r % num_stages`` of data-parallel replica ``r // num_stages``
    (the ``"pp"`` dimension is the inner one), so the stages of one pipeline are neighbours in rank order:
    with one pipeline per node, on one node, where the heavy point-to-point traffic stays; the replicas'
    all-reduce, once per optimizer step, crosses nodes.

    Args:
        world_size: number of processes in the job, ``num_nodes * devices``.
        num_stages: K, the number of pipeline stages (partitions) of each replica.

    Raises:
        ValueError: if ``world_size`` is not a positive multiple of ``num_stages``.
    """

    world_size: int
    num_stages: int

    def __post_init__(self) -> None:
        if self.num_stages < 1 or self.world_size % self.num_stages:
            raise ValueError(
                f"{self.world_size} processes cannot hold pipelines of {self.num_stages} stages:"
                " the number of devices must be a multiple of the number of stages."
            )

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
) -> Topology:
    """The mesh the strategy's arguments ask for, checked against the job's size.

    ``"auto"`` sizes follow Lightning's ``ModelParallelStrategy``: the pipeline takes the length of a list
    ``balance``, else the other size's quotient, else the devices of one node (each node holds one pipeline;
    the replicas are the nodes).

    Args:
        pipeline_parallel_size: K, the stages of each pipeline, or ``"auto"``.
        data_parallel_size: the pipeline replicas, or ``"auto"``.
        balance: the strategy's ``balance`` (a list fixes K).
        devices_per_node: processes per node (``devices``).
        num_nodes: nodes of the job.

    Raises:
        ValueError: if a size is neither a positive integer nor ``"auto"``, if the sizes' product is not
            the world size ``devices * num_nodes``, or if a list ``balance`` has another length than K.
    """
    world = devices_per_node * num_nodes
    pp = checked_size(pipeline_parallel_size, "pipeline_parallel_size")
    dp = checked_size(data_parallel_size, "data_parallel_size")
    listed = balance is not None and not isinstance(balance, str) and isinstance(balance, Sequence)
    if pp == "auto":
        pp = len(balance) if listed else (world // dp if dp != "auto" and world % dp == 0 else devices_per_node)
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
    if listed and len(balance) != pp:
        raise ValueError(
            f"GPipeStrategy(balance={list(balance)}) gives {len(balance)} stages, but the pipeline has {pp}"
            f" (pipeline_parallel_size={pipeline_parallel_size!r} of {world} processes). Give one balance entry per"
            " stage, or set pipeline_parallel_size to the length of balance."
        )
    return Topology(world_size=world, num_stages=pp)


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
