"""Where each stage lives: the one mapping between global ranks, pipeline ranks, data-parallel and tensor ranks.

The world is a mesh, data-parallel replicas x pipeline stages (x tensor-parallel ranks), built on torch's
:func:`~torch.distributed.device_mesh.init_device_mesh` with the dimensions named as Lightning's
``ModelParallelStrategy`` names them, ``("data_parallel", "pipeline_parallel"[, "tensor_parallel"])``, so its process
groups are torch's. Every other module asks this one for ranks and groups.

A mesh is made once per process and layout and reused by every later run of that process while its default process
group is the same (:data:`_MESHES`): each mesh's process groups hold threads (gloo: three per group) that stay until
the group is destroyed, and a group cannot be destroyed while torch still resolves it by name for the meshes and
``DTensor`` objects of an earlier run, so a new mesh per run would leave one more set of groups with every fit of a
notebook, a sweep or a test launch.
"""

import weakref
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_gpipe.engine.actions import stage_of_virtual, virtual_stage


@dataclass(frozen=True)
class Topology:
    """The (data-parallel x pipeline x tensor-parallel) mesh of one training run.

    Global rank ``r`` holds pipeline rank ``r % num_stages`` of data-parallel replica ``r // num_stages``
    (the pipeline dimension is the inner one), so the stages of one pipeline are neighbours in rank order:
    with one pipeline per node, on one node, where the heavy point-to-point traffic stays; the replicas'
    all-reduce, once per optimizer step, crosses nodes.

    With ``tensor_parallel_size`` T > 1 the tensor dimension is innermost (the GPUs of one node share the fastest
    links, and each layer's collectives run over them): global rank ``r`` is tensor rank ``r % T`` of pipeline rank
    ``(r // T) % K`` of replica ``r // (K * T)``. Each (replica, tensor rank) pair is one *pipeline* of K processes
    that exchange activations point to point (:meth:`pipeline_of`); the T pipelines of a replica run the same
    schedule in step, their layers' collectives joining them.

    With ``virtual_stages`` v > 1 the backbone is split into ``K * v`` virtual stages and pipeline rank k holds
    virtual stages k, k + K, k + 2K, ... (its model chunks 0, 1, 2, ...; Narayanan et al. 2021, section 2.2), or
    with ``v_shape`` virtual stages k and 2K - 1 - k (ZB-V's V, :func:`~lightning_gpipe.engine.actions.virtual_stage`).

    Args:
        world_size: number of processes in the job, ``num_nodes * devices``.
        num_stages: K, the number of pipeline stages (processes) of each replica.
        virtual_stages: v, the model chunks of each stage (default 1).
        v_shape: whether the two model chunks of each stage are placed in a V (default ``False``: looped).
        tensor_parallel_size: T, the tensor-parallel ranks of each stage (default 1).

    Raises:
        ValueError: if ``world_size`` is not a positive multiple of ``num_stages * tensor_parallel_size``,
            ``virtual_stages > 1`` with
            one stage (``v_shape``: with one stage, or other than two model chunks per stage).
    """

    world_size: int
    num_stages: int
    virtual_stages: int = 1
    v_shape: bool = False
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        per_replica = self.num_stages * self.tensor_parallel_size
        if self.num_stages < 1 or self.tensor_parallel_size < 1 or self.world_size % per_replica:
            tensor = f" x {self.tensor_parallel_size} tensor-parallel ranks" if self.tensor_parallel_size > 1 else ""
            raise ValueError(
                f"{self.world_size} processes cannot hold pipelines of {self.num_stages} stages{tensor}:"
                " the number of devices must be a multiple of the processes of one replica."
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
        """Number of pipeline replicas (D)."""
        return self.world_size // (self.num_stages * self.tensor_parallel_size)

    @property
    def num_pipelines(self) -> int:
        """``D * T``: the pipelines of the job, each K processes that exchange activations (see the class
        docstring); D without tensor parallelism."""
        return self.world_size // self.num_stages

    def stage_of(self, rank: int) -> int:
        """Pipeline rank (the stage index, 0-based) of global rank ``rank``."""
        return (rank // self.tensor_parallel_size) % self.num_stages

    def replica_of(self, rank: int) -> int:
        """Data-parallel rank of global rank ``rank``."""
        return rank // (self.num_stages * self.tensor_parallel_size)

    def tensor_rank_of(self, rank: int) -> int:
        """Tensor-parallel rank of global rank ``rank`` (0 without tensor parallelism)."""
        return rank % self.tensor_parallel_size

    def pipeline_of(self, rank: int) -> int:
        """The pipeline (``replica * T + tensor rank``; the replica without tensor parallelism) that global rank
        ``rank`` is a stage of."""
        return self.replica_of(rank) * self.tensor_parallel_size + self.tensor_rank_of(rank)

    def rank_of(self, stage_index: int, pipeline: int) -> int:
        """Global rank holding stage ``stage_index`` of pipeline ``pipeline`` (:meth:`pipeline_of`: the data-parallel
        replica without tensor parallelism)."""
        replica, tensor_rank = divmod(pipeline, self.tensor_parallel_size)
        return (replica * self.num_stages + stage_index) * self.tensor_parallel_size + tensor_rank

    def rank_of_virtual(self, virtual: int, pipeline: int) -> int:
        """Global rank holding virtual stage ``virtual`` of pipeline ``pipeline`` (see the class docstring)."""
        return self.rank_of(stage_of_virtual(virtual, self.num_stages, self.v_shape)[0], pipeline)

    def name(self, rank: int) -> str:
        """How messages name global rank ``rank``: ``"stage 1"``, or ``"stage 1 of replica 0 (rank 1)"`` with
        several replicas, ``"stage 1, tensor rank 1 of replica 0 (rank 3)"`` with tensor parallelism."""
        stage = f"stage {self.stage_of(rank)}"
        if self.tensor_parallel_size > 1:
            return f"{stage}, tensor rank {self.tensor_rank_of(rank)} of replica {self.replica_of(rank)} (rank {rank})"
        return stage if self.data_parallel_size == 1 else f"{stage} of replica {self.replica_of(rank)} (rank {rank})"

    def mesh(self, device_type: str) -> DeviceMesh:
        """The device mesh of this topology, its dimensions named ``("data_parallel", "pipeline_parallel")`` and,
        with tensor parallelism, ``"tensor_parallel"`` innermost (a collective call on every process of the job, the
        first time this process asks for the layout; later runs of the process get the same mesh, :data:`_MESHES`).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``: the type of the processes' devices.
        """
        sizes, names = [self.data_parallel_size, self.num_stages], [DATA_PARALLEL, PIPELINE_PARALLEL]
        if self.tensor_parallel_size > 1:
            sizes, names = [*sizes, self.tensor_parallel_size], [*names, TENSOR_PARALLEL]
        layout = (device_type, tuple(sizes), tuple(names))
        world = dist.group.WORLD
        assert world is not None, "the mesh is made after the job's default process group"
        meshes = _MESHES.setdefault(world, {})
        if layout not in meshes:
            meshes[layout] = init_device_mesh(device_type, layout[1], mesh_dim_names=layout[2])
        return meshes[layout]


_MESHES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()
"""The meshes this process made, by default process group and layout ``(device type, sizes, names)``: the one
process-wide state of the package (see the module docstring). Every process of a job asks for the same layouts in the
same order (the mesh is collective), so every process finds or makes the same ones."""


DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL = "data_parallel", "pipeline_parallel", "tensor_parallel"
"""The mesh's dimension names: Lightning's ``ModelParallelStrategy``'s for data and tensor parallelism, and the
pipeline's."""


def replicas_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh of this process's stage's replicas (with tensor parallelism: of its stage and tensor rank), a
    slice of ``mesh`` (:meth:`Topology.mesh`), so that FSDP2 over it composes with a tensor-parallel ``DTensor``'s
    mesh of the same root."""
    return mesh[DATA_PARALLEL]


def groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This process's ``(pipeline group, data-parallel group)`` of ``mesh``: the stages of its pipeline, and the
    replicas of its stage (with tensor parallelism: of its stage and tensor rank)."""
    return mesh.get_group(PIPELINE_PARALLEL), mesh.get_group(DATA_PARALLEL)
