"""What the planner chooses beyond micro-batches, re-materialization and the balance (issue 59): the schedules that
split their backwards (V-Min and the other V schedules among them), activation offload on an accelerator, the
sharding of a stage's state and, in the strategy, that what it chose is what runs. Synthetic costs, injected cost
models: no clock decides a test."""

import dataclasses
from itertools import product
from types import SimpleNamespace

import pytest

from lightning_gpipe.lightning.build import sharded_state_copies
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.measure import planned_config
from lightning_gpipe.planning import (
    Constraints,
    PipelinePlan,
    measure_host_bandwidth,
    predict,
    search,
    solve,
    state_copies,
)
from lightning_gpipe.planning.balance import LayerCost, layer_weights
from lightning_gpipe.planning.report import PlanReport

from .test_planning import FREE, SmallMLP, profiled, split_profiled


def activation_heavy(split: bool = True, rows: int = 1024, pairs: int = 8):
    """:func:`~test_planning.profiled` (with B and W measured where ``split``) whose layers save 8 times as much: the
    activations, not the parameters or the batch, decide what fits."""
    costs = split_profiled(pairs, rows) if split else profiled(pairs, rows)

    def heavy(layers: list[LayerCost]) -> list[LayerCost]:
        return [dataclasses.replace(c, activation_bytes=8 * c.activation_bytes) for c in layers]

    return dataclasses.replace(costs, large=heavy(list(costs.large)), small=heavy(list(costs.small)))


def usable(peak: int) -> int:
    """The limit whose usable part (less the cost model's margin) is ``peak`` bytes."""
    return int(peak / (1 - FREE.memory_margin)) + 1


def test_a_v_schedule_is_chosen_where_only_it_fits():
    """V-Min holds a third of 1F1B's activations: under a limit only it fits, the planner runs it, with its V's two
    model chunks per stage; without B and W profiled it is not considered, and nothing fits."""
    costs, fixed = activation_heavy(), Constraints(pipeline_parallel_size=4, micro_batches=8, checkpoint="never")
    everything = search(4, costs, 2**40, 2, FREE, fixed).predictions
    v_min = min(p.peak_bytes for p in everything if p.plan.schedule == "v-min")
    assert v_min < min(p.peak_bytes for p in everything if p.plan.schedule != "v-min")
    chosen = search(4, costs, usable(v_min), 2, FREE, fixed).chosen.plan
    assert (chosen.schedule, chosen.virtual_stages) == ("v-min", 2)
    with pytest.raises(ValueError, match="No pipeline plan fits"):
        search(4, activation_heavy(split=False), usable(v_min), 2, FREE, fixed)


OFFLOADED = Constraints(pipeline_parallel_size=2, micro_batches=8, schedule="gpipe", virtual_stages=1)
"""The offload tests' candidates: the re-materialization mode and offload are left to the planner."""


def _offload_limit() -> int:
    """A limit that plans keeping every activation (``"never"``) fit only with offload, and a re-materialized one
    fits."""
    found = search(2, activation_heavy(split=False), 2**40, 2, FREE, OFFLOADED, "cuda").predictions
    offloaded = min(p.peak_bytes for p in found if p.plan.offload)
    kept = min(p.peak_bytes for p in found if p.plan.checkpoint == "never" and not p.plan.offload)
    recomputed = min(p.peak_bytes for p in found if p.plan.checkpoint == "always")
    assert max(offloaded, recomputed) < kept
    return usable(max(offloaded, recomputed))


def test_offload_is_chosen_on_an_accelerator_where_it_fits_and_its_copies_are_cheap_never_on_a_cpu():
    costs, limit = activation_heavy(split=False), _offload_limit()
    cheap = dataclasses.replace(FREE, host_bandwidth=float("inf"))
    chosen = search(2, costs, limit, 2, cheap, OFFLOADED, "cuda").chosen.plan
    assert (chosen.checkpoint, chosen.offload) == ("never", "activations")
    assert chosen.options()["offload"] == "activations"
    costly = dataclasses.replace(FREE, host_bandwidth=1e6)  # 1 MB/s: the copies cost more than recomputing
    assert search(2, costs, limit, 2, costly, OFFLOADED, "cuda").chosen.plan.offload is None
    on_cpu = search(2, costs, limit, 2, cheap, OFFLOADED, "cpu")
    assert not any(p.plan.offload for p in on_cpu.predictions) and on_cpu.chosen.plan.checkpoint != "never"
    plan = dataclasses.replace(on_cpu.chosen.plan, checkpoint="never")  # offload fixed on a CPU: it moves nothing
    offloaded = dataclasses.replace(plan, offload="activations")
    assert predict(offloaded, costs, cheap, 2, limit) == dataclasses.replace(
        predict(plan, costs, cheap, 2, limit), plan=offloaded
    )
    assert (
        predict(offloaded, costs, cheap, 2, limit, "cuda").peak_bytes < predict(plan, costs, cheap, 2, limit).peak_bytes
    )
    with pytest.raises(ValueError, match="needs a CUDA device"):  # the bandwidth is measured on CUDA, or given
        measure_host_bandwidth("cpu")


def test_sharding_is_chosen_where_only_it_fits_and_whole_state_otherwise():
    """With several replicas the planner weighs FSDP2's shards (``"SHARD_GRAD_OP"``) against whole state: at equal
    predicted time whole state, sharded where only that fits; a fixed strategy is kept."""
    costs, fixed = profiled(pairs=8, rows=64), Constraints(pipeline_parallel_size=1, micro_batches=4)
    found = search(2, costs, 2**40, 2, FREE, fixed)
    assert {p.plan.sharding_strategy for p in found.predictions} == {"NO_SHARD", "SHARD_GRAD_OP"}
    assert found.chosen.plan.sharding_strategy == "NO_SHARD"
    sharded = min(p.peak_bytes for p in found.predictions if p.plan.sharding_strategy != "NO_SHARD")
    assert sharded < min(p.peak_bytes for p in found.predictions if p.plan.sharding_strategy == "NO_SHARD")
    chosen = search(2, costs, usable(sharded), 2, FREE, fixed).chosen.plan
    assert chosen.options()["sharding_strategy"] == "SHARD_GRAD_OP"
    with pytest.raises(ValueError, match="No pipeline plan fits"):
        search(2, costs, usable(sharded), 2, FREE, dataclasses.replace(fixed, sharding_strategy="NO_SHARD"))


def test_sharded_state_is_counted_as_the_run_holds_it_by_the_planner_and_by_balance_memory():
    """1/D of parameters, gradients and AdamW's state per process, plus the gathered parameters and unsharded
    gradients of the backward: what predict counts, and what the planner's additive memory and ``balance="memory"``
    count."""
    plan = PipelinePlan(1, 2, 4, "never", "1f1b", (8,), sharding_strategy="SHARD_GRAD_OP")
    memory = predict(plan, profiled(), FREE, 2, 2**40).memory[0]
    p = sum(c.parameter_bytes for c in profiled().large)
    assert memory.parameters + memory.gradients + memory.optimizer == state_copies(2, 2, sharded=True) * p == 4 * p
    whole = predict(dataclasses.replace(plan, sharding_strategy="NO_SHARD"), profiled(), FREE, 2, 2**40).memory[0]
    assert whole.parameters + whole.gradients + whole.optimizer + p == state_copies(2, 2) * p == 5 * p  # DDP's buckets
    costs = [LayerCost(0, 0, activation_bytes=10, parameter_bytes=100), LayerCost(0, 0, activation_bytes=300)]
    assert layer_weights("memory", costs, state_copies(2, 2, sharded=True)) == [410, 300]
    config = PipelineConfig(balance="memory", sharding_strategy="SHARD_GRAD_OP")
    assert sharded_state_copies(SmallMLP(), config, 2) == 4  # Adam, read from configure_optimizers
    assert sharded_state_copies(SmallMLP(), dataclasses.replace(config, sharding_strategy="NO_SHARD"), 2) == 1
    assert sharded_state_copies(SmallMLP(), config, 1) == 1


def test_the_strategy_runs_what_the_planner_chose_and_leaves_free_what_the_user_left_free():
    """``planned_config`` gives the chosen schedule (with its two model chunks), sharding and offload to the config the
    stages are built from; the sharding and offload the user did not give are the planner's, one given is kept, and
    compile keeps the state whole."""
    chosen = PipelinePlan(2, 2, 8, "never", "v-min", (1, 1, 1, 1), 2, "SHARD_GRAD_OP", "activations")
    prediction = predict(chosen, profiled(pairs=2), FREE, 2, 2**40)
    report = PlanReport([prediction], 2**40, 4, FREE, profiled(pairs=2), 2)
    strategy = SimpleNamespace(plan_report=report)
    module = SimpleNamespace(backbone=[None] * 4)
    config = planned_config(strategy, PipelineConfig(plan="auto", memory_limit=2**30), module, "backbone")
    ran = {key: getattr(config, key) for key in ("schedule", "virtual_stages", "sharding_strategy", "offload")}
    assert ran == {
        "schedule": "v-min",
        "virtual_stages": 2,
        "sharding_strategy": "SHARD_GRAD_OP",
        "offload": "activations",
    }
    assert (config.chunks, config.checkpoint, config.balance, config.splits_backward) == (
        8,
        "never",
        [1, 1, 1, 1],
        True,
    )
    assert report.as_dict()["chosen"]["offload"] == "activations" and "off" in report.table()
    free = PipelineConfig(plan="auto", memory_limit=1).constraints()
    assert (free.sharding_strategy, free.offload, free.splits) == (None, None, True)
    given = PipelineConfig(plan="auto", memory_limit=1, sharding_strategy="NO_SHARD", offload="activations")
    assert (given.constraints().sharding_strategy, given.constraints().offload) == ("NO_SHARD", "activations")
    assert PipelineConfig(plan="auto", memory_limit=1, compile=True).constraints().sharding_strategy == "NO_SHARD"
    assert PipelineConfig().sharding_strategy == "NO_SHARD"


def _grid(costs, world: int, limit: int, micro_batches: tuple[int, ...]) -> list:
    """Every plan of a grid predicted, each at its time-optimal balance: meshes, M, modes, every schedule (a V with
    two model chunks), one and two model chunks, sharding and offload."""
    found = []
    for k, m, mode, name, v, sharding, offload in product(
        (1, 2, 4), micro_batches, ("never", "always"), ("gpipe", "1f1b", "zb-1p", "v-min", "v-half", "v-zb"),
        (1, 2), ("NO_SHARD", "SHARD_GRAD_OP"), (None, "activations"),
    ):  # fmt: skip
        if (
            (name.startswith("v-") and (v != 2 or k == 1))
            or (v == 2 and k == 1)
            or (sharding != "NO_SHARD" and k == world)
        ):
            continue
        balance = tuple(solve([c.forward + c.backward for c in costs.for_micro_batches(m)], k * v))
        plan = PipelinePlan(k, world // k, m, mode, name, balance, v, sharding, offload)
        found.append(predict(plan, costs, FREE, 2, limit, "cuda"))
    return found


def test_the_planners_choice_fits_and_is_within_ten_percent_of_the_best_plan_of_a_grid():
    """The figure of issue 59, on predicted times: under a limit that binds, the planner's plan fits and is within 10%
    of the fastest fitting plan of an exhaustive grid over the new schedules, offload, sharding and D."""
    costs = activation_heavy(rows=512)
    unlimited = _grid(costs, 4, 2**40, (8,))
    limit = sorted(p.peak_bytes for p in unlimited)[len(unlimited) // 3]  # a third of the grid fits
    grid = [p for p in _grid(costs, 4, limit, (8,)) if p.fits]
    best = min(grid, key=lambda p: p.seconds_per_row)
    assert best.plan.schedule.startswith("v-") or best.plan.offload or best.plan.sharding_strategy != "NO_SHARD"
    chosen = search(4, costs, limit, 2, FREE, Constraints(micro_batches=8), "cuda").chosen
    assert chosen.fits and chosen.peak_bytes <= limit
    assert chosen.seconds_per_row <= 1.10 * best.seconds_per_row
