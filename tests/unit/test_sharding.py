"""Sharded data parallelism in this process: ``sharding_strategy``'s checks before any process starts, the FSDP units a
stage is cut into, and FSDP2 driven through a one-stage pipeline on a one-process gloo group (a replica of one, whose
shards are whole): a step's gradients equal the plain module's, the pipeline's first backward of each step keeps the
parameters gathered, evaluation begins no backward, and the module leaves plain, to be sharded again. The (2 x 2)
meshes on 4 processes: tests/distributed/test_sharding.py."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import one_stage_pipeline
from models import TupleNet, loader
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine import Topology, replicas_mesh
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.data_parallel import FullyShardedStage, units
from lightning_gpipe.lightning.optimization import pipelined


@pytest.mark.parametrize("sharding", ["SHARD_GRAD_OP", "FULL_SHARD"])
def test_compile_with_sharding_is_refused_naming_the_fix(sharding):
    with pytest.raises(ValueError, match="set compile=False, or sharding_strategy='NO_SHARD' to keep compile"):
        GPipeStrategy(sharding_strategy=sharding, compile=True)


def test_a_bad_sharding_strategy_names_the_choices():
    with pytest.raises(ValueError, match="choose 'NO_SHARD' .*'SHARD_GRAD_OP' or 'FULL_SHARD'"):
        GPipeStrategy(sharding_strategy="HYBRID_SHARD")


def test_a_gradient_scaler_with_sharding_is_refused_naming_the_fix():
    class Plugin:
        scaler = torch.amp.GradScaler("cpu")

    with pytest.raises(ValueError, match="use precision='bf16-mixed' .* or sharding_strategy='NO_SHARD'"):
        pipelined(Plugin(), None, list, Job(), holders=2)


def test_a_layer_sharing_a_parameter_or_used_twice_is_left_to_the_root():
    """A chunk's units are its layers that own their parameters alone; a layer used at two positions, one whose weight
    is the head's, and one without parameters are not."""
    shared, tied, own = nn.Linear(2, 2), nn.Embedding(3, 2), nn.Linear(2, 2)
    chunk = nn.Sequential(tied, shared, nn.Tanh(), shared, own)
    head = nn.Linear(2, 3, bias=False)
    head.weight = tied.weight
    trained = nn.ModuleDict({"backbone": chunk, "head": head})
    assert units(trained, [chunk]) == [[own]]
    assert units(trained, [nn.Sequential(nn.Tanh())]) == []


@pytest.fixture
def one_replica():
    """The mesh of a one-stage pipeline with one replica, on a one-process gloo group."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Topology(1, 1).mesh("cpu")
    finally:
        dist.destroy_process_group()


def _step(module, runtime, sharded, batch) -> None:
    """One training step of the one-stage pipeline: the fill, the loss to the boundary, the drain, the reduction."""
    x, y = batch
    sharded.begin_step()
    output = module.backbone((x, x > -1.0))
    F.cross_entropy(module.head(output), y).backward()
    runtime.backward()
    sharded.finish_backward()


@pytest.mark.parametrize("full_shard", [True, False])
def test_a_sharded_one_stage_pipeline_steps_like_the_plain_module_and_leaves_it_plain(one_replica, full_shard):
    torch.manual_seed(0)
    module = TupleNet()
    reference = copy.deepcopy(module)
    runtime = one_stage_pipeline(module, chunks=3, checkpoint="except_last", defer_weight_grad=True)
    sharded = FullyShardedStage(module.backbone, [module.backbone], replicas_mesh(one_replica), full_shard, Job())
    begun: list[int] = []
    runtime.before_first_backward = lambda: (begun.append(1), sharded.begin_backward())
    assert all(isinstance(p, DTensor) for p in module.backbone.parameters())
    batch = next(iter(loader()))
    _step(module, runtime, sharded, batch)
    x, y = batch
    F.cross_entropy(reference.head(reference.backbone((x, x > -1.0))), y).backward()
    for (name, got), want in zip(module.backbone.named_parameters(), reference.backbone.parameters(), strict=True):
        assert isinstance(got.grad, DTensor), name
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, atol=1e-6, rtol=0, msg=name)
    with torch.no_grad():
        sharded.begin_step()
        module.backbone((x, x > -1.0))
        sharded.end_evaluation_step()
    assert begun == [1]  # once in the training step, never in evaluation

    with torch.no_grad():
        for p in module.backbone.parameters():
            p.to_local().add_(1.0)  # an optimizer step on the shards
    sharded.release()
    layers = list(module.backbone.children())
    assert not any(isinstance(layer, FSDPModule) for layer in layers)
    assert all(type(p) is nn.Parameter for p in module.backbone.parameters())
    assert all(not layer._forward_pre_hooks and not layer._forward_hooks for layer in layers)
    for got, want in zip(module.backbone.parameters(), reference.backbone.parameters(), strict=True):
        torch.testing.assert_close(got, want + 1.0)
    again = FullyShardedStage(module.backbone, [module.backbone], replicas_mesh(one_replica), full_shard, Job())
    again.release()


def test_the_causal_lm_examples_sharded_config_makes_2_stages_of_2_fully_sharded_replicas(monkeypatch):
    """examples/causal_lm/configs/fsdp.yaml parses with the example's command line into a GPipeStrategy of 2 stages
    x 2 replicas sharded by FULL_SHARD on 4 processes, reading the defaults' 32 sentences a step (16 per replica)."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    from causal_lm.train import main

    cli = main(["--config", str(examples / "causal_lm" / "configs" / "fsdp.yaml")], run=False)
    config = cli.trainer.strategy.config
    assert isinstance(cli.trainer.strategy, GPipeStrategy)
    assert (config.pipeline_parallel_size, config.data_parallel_size) == (2, 2)
    assert config.sharding_strategy == "FULL_SHARD"
    assert cli.trainer.num_devices == 4
    assert cli.datamodule.batch_size * config.data_parallel_size == main([], run=False).datamodule.batch_size


def _profiled_mlp():
    """The planner's costs of 8 layers of 1 MiB of parameters each (batches of 64 rows, and of 1)."""
    from lightning_gpipe.planning import ProfiledCosts
    from lightning_gpipe.planning.balance import LayerCost

    def layers(rows: int) -> list:
        return [LayerCost(1e-6 * rows, 2e-6 * rows, 1024 * rows, 1024 * rows, 2**20)] * 8

    return ProfiledCosts((64, 1), layers(64), layers(1), 64, 1024 * 64)


def test_plan_auto_counts_each_processs_shard_of_the_state_and_the_backwards_gathered_copies():
    """``plan="auto"``'s prediction of a sharded (2, 2) plan: per process, 1/D of each stage's parameters, gradients
    and optimizer state, and in the backward the gathered parameters and unsharded gradients on top (16 P / D + 8 P
    with AdamW, docs/scaling.md), no DDP buckets; DDP's and one replica's as before. The search predicts with the
    strategy's ``sharding_strategy`` and names it in the chosen options."""
    from dataclasses import replace

    from lightning_gpipe.planning import Constraints, CostModel, PipelinePlan, predict, search

    costs, model, adamw, p = _profiled_mlp(), CostModel(), 2, 4 * 2**20  # 4 layers of 1 MiB per stage
    ddp = PipelinePlan(2, 2, 4, "never", "gpipe", (4, 4))
    sharded = predict(replace(ddp, sharding_strategy="FULL_SHARD"), costs, model, adamw, 2**40).memory
    whole = predict(ddp, costs, model, adamw, 2**40).memory
    for s, w in zip(sharded, whole):
        assert (s.parameters, s.gradients, s.optimizer) == (p // 2 + p, p // 2 + p, adamw * p // 2)
        assert (w.parameters, w.gradients, w.optimizer) == (p, p, adamw * p)
        assert w.buffers - s.buffers == p  # DDP's gradient buckets
        assert w.total - s.total == 2 * p - 2 * p // 2  # 20 P against 16 P / 2 + 8 P
    one_replica = replace(ddp, data_parallel_size=1)
    assert predict(replace(one_replica, sharding_strategy="FULL_SHARD"), costs, model, adamw, 2**40).memory == (
        predict(one_replica, costs, model, adamw, 2**40).memory
    )
    constraints = Constraints(pipeline_parallel_size=2, data_parallel_size=2, sharding_strategy="SHARD_GRAD_OP")
    report = search(4, costs, 2**40, adamw, model, constraints)
    assert all(prediction.plan.sharding_strategy == "SHARD_GRAD_OP" for prediction in report.predictions)
    assert report.chosen.plan.options()["sharding_strategy"] == "SHARD_GRAD_OP"
    assert "sharding_strategy" not in ddp.options()
    strategy = GPipeStrategy(plan="auto", data_parallel_size=2, sharding_strategy="SHARD_GRAD_OP")
    assert strategy.config.constraints().sharding_strategy == "SHARD_GRAD_OP"  # what the strategy's planner searches
