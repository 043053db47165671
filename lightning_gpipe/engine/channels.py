"""A process group of its own for every point-to-point link that may share a pair of ranks with another link.

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

import torch.distributed as dist

from lightning_gpipe.engine.skip import SkipLayout
from lightning_gpipe.engine.topology import Topology

LinkKey = tuple[int, int, int]
"""A link of the job: ``(data-parallel replica, sending virtual stage, receiving virtual stage)``."""


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
    for replica in range(topology.data_parallel_size):
        for src, dst in pairs:
            ranks = sorted({topology.rank_of_virtual(src, replica), topology.rank_of_virtual(dst, replica)})
            if len(ranks) == 2:
                group = dist.new_group(ranks)
                if rank in ranks:
                    groups[(replica, src, dst)] = group
    return groups
