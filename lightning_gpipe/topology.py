"""Where each stage lives: the one mapping between global ranks and pipeline ranks.

The world is a 2-D mesh, data-parallel replicas x pipeline stages. Today the
data-parallel size is 1, so pipeline rank == global rank; every other module asks
this one for ranks so that adding data parallelism later changes only this file.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    """The (data-parallel x pipeline) mesh of one training run.

    Global rank ``r`` holds pipeline rank ``r % num_stages`` of data-parallel
    replica ``r // num_stages``, so the stages of one pipeline are neighbours in
    rank order (and, on one node, on neighbouring devices).

    Args:
        world_size: number of processes in the job, ``num_nodes * devices``.
        num_stages: K, the number of pipeline stages (partitions).

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
