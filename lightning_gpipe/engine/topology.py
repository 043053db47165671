"""Where each stage lives: the one mapping between global ranks, pipeline ranks and data-parallel ranks.

The world is a 2-D mesh, data-parallel replicas x pipeline stages, built on torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` with the dimensions named ``("dp", "pp")``, so its
process groups are torch's. Every other module asks this one for ranks and groups.
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.engine.actions import stage_of_virtual, virtual_stage


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
        if self.num_stages == 1 and (self.v_shape or self.virtual_stages > 1):
            raise ValueError(
                f"{self.virtual_stages} virtual stages per stage{' in a V' if self.v_shape else ''} interleave model"
                " chunks between the stages, but the pipeline has one stage."
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


def groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's ``(pipeline group, data-parallel group)`` of ``mesh``: the stages of its replica, and the
    replicas of its stage."""
    return mesh.get_group("pp"), mesh.get_group("dp")
