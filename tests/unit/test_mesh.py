"""Pipeline x data parallelism, checked in this process: the mesh's sizes, its errors before any process starts,
the rank mapping, and traces of several nodes on one clock (the mesh trained on stage processes:
tests/distributed/test_mesh.py)."""

import lightning as L
import pytest

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.lightning.mesh import resolve_topology


@pytest.mark.parametrize(
    "pp, dp, balance, devices, nodes, expected",
    [
        ("auto", "auto", None, 4, 1, (4, 1)),  # one node: one pipeline of every device
        ("auto", "auto", None, 2, 3, (2, 3)),  # pipeline within a node, replicas across nodes
        ("auto", "auto", [3, 5], 4, 1, (2, 2)),  # a list balance fixes K
        ("auto", 2, None, 4, 2, (4, 2)),
        (2, "auto", None, 8, 1, (2, 4)),
    ],
)
def test_auto_mesh_sizes(pp, dp, balance, devices, nodes, expected):
    topology = resolve_topology(pp, dp, balance, devices, nodes)
    assert (topology.num_stages, topology.data_parallel_size) == expected


def test_virtual_stages_take_k_times_v_balance_entries_and_one_tag_per_link():
    topology = resolve_topology("auto", "auto", [1, 2, 3, 2], 2, 1, virtual_stages=2)
    assert (topology.num_stages, topology.num_virtual, topology.virtual_of(1)) == (2, 4, [1, 3])
    tags = [topology.link_tag(s) for s in range(3)] + [topology.skip_tag(s, t) for s in range(4) for t in range(4)]
    assert len(set(tags)) == len(tags) and 0 not in tags and 1 not in tags  # 0 and 1: the tags without chunks
    assert (Topology(2, 2).link_tag(0), Topology(2, 2).skip_tag(0, 1)) == (0, 1)


def test_a_v_holds_virtual_stages_k_and_2k_minus_1_minus_k_and_the_head_on_stage_0():
    topology = resolve_topology("auto", 2, None, 3, 2, virtual_stages=2, v_shape=True)
    assert [topology.virtual_of(k) for k in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert (topology.last_stage, Topology(6, 3, virtual_stages=2).last_stage, Topology(6, 3).last_stage) == (0, 2, 2)
    assert [topology.rank_of_virtual(s, pipeline=1) for s in range(6)] == [3, 4, 5, 5, 4, 3]
    with pytest.raises(ValueError, match="A V places two model chunks per stage, not virtual_stages=3"):
        Topology(6, 3, virtual_stages=3, v_shape=True)


@pytest.mark.parametrize(
    "kwargs, devices, match",
    [
        (dict(pipeline_parallel_size=3, data_parallel_size=2), 4, "makes a mesh of 3 stages x 2 replicas = 6"),
        (dict(pipeline_parallel_size=2, balance=[1, 2, 5]), 4, r"gives 3 stages, but the pipeline has 2"),
        (dict(data_parallel_size=3), 4, "processes, but the job has 4"),
        (dict(virtual_stages=2, balance=[1, 2, 5]), 4, r"3 is not a multiple of 2"),
        (dict(virtual_stages=2, pipeline_parallel_size=4, balance=[1, 2, 5, 1]), 4, r"per virtual stage \(4 stages x"),
        (dict(virtual_stages=2), 1, "the pipeline has one stage; use virtual_stages=1"),
        (dict(schedule="zb-v"), 1, "in a V across the stages, but the pipeline has one stage; use more devices"),
    ],
)
def test_a_mesh_that_does_not_fit_fails_before_any_process_starts(kwargs, devices, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(strategy=GPipeStrategy(**kwargs), devices=devices, accelerator="cpu")


@pytest.mark.parametrize("size", [0, -1, 1.5, "two", True])
def test_a_bad_mesh_size_fails_at_construction(size):
    with pytest.raises(ValueError, match="give a positive integer or 'auto'"):
        GPipeStrategy(data_parallel_size=size)


def test_rank_mapping_keeps_a_pipeline_on_neighbouring_ranks():
    topology = Topology(world_size=8, num_stages=4)
    assert [topology.rank_of(stage, 1) for stage in range(4)] == [4, 5, 6, 7]
    assert [(topology.stage_of(r), topology.replica_of(r)) for r in (0, 5)] == [(0, 0), (1, 1)]
    assert topology.name(6) == "stage 2 of replica 1 (rank 6)"
    assert Topology(world_size=2, num_stages=2).name(1) == "stage 1"


def test_traces_of_another_node_are_moved_onto_rank_zeros_clock():
    from lightning_gpipe.engine.events import Span
    from lightning_gpipe.engine.trace import StageTrace
    from lightning_gpipe.lightning.callbacks._pipeline import _on_one_clock

    def trace(stage, start):
        return StageTrace(stage, [Span("forward", 0, start, start + 1.0)], start, start + 2.0)

    # stage 1 runs on a node whose clock reads 1000 s more; both left the barrier at 10.0 on their own clocks
    parts = [(trace(0, 11.0), 10.0, "node0"), (trace(1, 1011.5), 1010.0, "node1"), (trace(2, 12.0), 10.2, "node0")]
    stages = _on_one_clock(parts)
    assert [(s.stage, s.start, s.spans[0].end) for s in stages] == [(0, 11.0, 12.0), (1, 11.5, 12.5), (2, 12.0, 13.0)]


def test_a_process_makes_the_mesh_of_a_layout_once_and_a_new_job_makes_its_own():
    """Each mesh's process groups keep threads until destroyed: later runs of a process reuse its mesh of the layout
    (a notebook's second fit adds no group), while a new default process group (a new job) gets new meshes."""
    import torch.distributed as dist

    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    meshes = []
    for _ in range(2):  # two jobs, one after the other, in this process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            meshes.append(Topology(1, 1).mesh("cpu"))
            made = groups()
            assert Topology(1, 1).mesh("cpu") is meshes[-1] and groups() == made
            assert Topology(1, 1).mesh("meta") is not meshes[-1]  # the layout includes the device type
        finally:
            dist.destroy_process_group()
    assert meshes[0] is not meshes[1]
