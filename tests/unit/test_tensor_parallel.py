"""Tensor parallelism's parts in one process: the mesh's ranks with a tensor dimension, the sizes and options it
refuses before any process starts, Lightning's ``configure_model`` deferred until after the split, and the check of
what it split (a layer the stage does not hold is refused; the module leaves the run plain). The runs that train:
tests/distributed/test_tensor_parallel.py."""

import dataclasses

import lightning as L
import pytest
import torch
import torch.distributed as dist
from tensor_parallel import BLOCK_PLAN, PLAN, SplitMLP
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine import Topology
from lightning_gpipe.lightning._lightning import configure_model_after_split
from lightning_gpipe.lightning.config import PipelineConfig, check_tensor_parallel_replicas
from lightning_gpipe.lightning.mesh import resolve_topology
from lightning_gpipe.lightning.tensor_parallel import TensorSplit, layer_splits


def test_the_tensor_dimension_is_innermost_and_each_tensor_rank_has_its_own_pipeline():
    """Rank ``(d * K + k) * T + t``: with K = 2, D = 2, T = 2, the tensor ranks of a stage are neighbours, and the
    point-to-point neighbours of a process are the same tensor rank of the next stage."""
    topology = Topology(8, 2, tensor_parallel_size=2)
    assert topology.data_parallel_size == 2 and topology.num_pipelines == 4
    assert [topology.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [topology.tensor_rank_of(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [topology.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [[topology.rank_of(k, p) for k in range(2)] for p in range(4)] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all(topology.rank_of(topology.stage_of(r), topology.pipeline_of(r)) == r for r in range(8))
    assert topology.name(3) == "stage 1, tensor rank 1 of replica 0 (rank 3)"


def test_the_sizes_count_stages_of_t_processes_and_a_mesh_that_does_not_fit_is_refused():
    assert resolve_topology("auto", "auto", None, 4, 1, tensor_parallel_size=2).num_stages == 2
    one_stage = resolve_topology(1, "auto", None, 4, 1, tensor_parallel_size=2)
    assert (one_stage.num_stages, one_stage.data_parallel_size) == (1, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3\) splits .* devices=4 .* divides devices"):
        resolve_topology("auto", "auto", None, 4, 1, tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"2 stages x 2 replicas x 2 tensor ranks = 8 processes, but the job has 4"):
        resolve_topology(2, 2, None, 4, 1, tensor_parallel_size=2)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(tensor_parallel_size=0), r"tensor_parallel_size=0\): give a positive integer"),
        (dict(tensor_parallel_size="2"), r"tensor_parallel_size='2'\): give a positive integer"),
        (dict(tensor_parallel_size=2, compile=True), r"compile=True\): compiled layers .*; leave compile=False\.$"),
        (dict(tensor_parallel_size=2, compile={"dynamic": False}), r"compile=\{'dynamic': False\}\): compiled"),
        (
            dict(tensor_parallel_size=2, offload="activations"),
            r"offload='activations'\): offloading DTensor .*; leave offload=None",
        ),
    ],
)
def test_options_tensor_parallelism_does_not_take_yet_are_refused_before_any_process_starts(options, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**options)


def test_the_planner_never_plans_offload_for_tensor_parallel_stages():
    """On an accelerator the planner weighs activation offload, but not for tensor-parallel stages, which refuse it."""
    from lightning_gpipe.planning import Constraints, CostModel, ProfiledCosts, search

    module = SplitMLP()
    costs = ProfiledCosts((8, 2), _block_costs(module, 8), _block_costs(module, 2), 32, 4 * 16 * 32)
    fixed = Constraints(pipeline_parallel_size=2, micro_batches=4, checkpoint="never", schedule="gpipe")
    for tensor in (1, 2):
        report = search(
            2 * tensor, costs, 2**40, 2, CostModel(), dataclasses.replace(fixed, tensor_parallel_size=tensor), "cuda"
        )
        offloads = {prediction.plan.offload for prediction in report.predictions}
        assert offloads == ({None, "activations"} if tensor == 1 else {None})


def test_replicas_of_tensor_parallel_stages_are_sharded_by_fsdp2_not_ddp():
    check_tensor_parallel_replicas(PipelineConfig(tensor_parallel_size=2, sharding_strategy="FULL_SHARD"), 2)
    check_tensor_parallel_replicas(PipelineConfig(tensor_parallel_size=2), 1)
    with pytest.raises(ValueError, match="DDP does not take the tensor-parallel .* sharding_strategy='FULL_SHARD'"):
        check_tensor_parallel_replicas(PipelineConfig(tensor_parallel_size=2), 2)


def test_configure_model_runs_after_the_split_and_before_it_only_where_it_creates_the_backbone():
    calls = []

    class Configured(L.LightningModule):
        def configure_model(self):
            calls.append(self)

    module = Configured()
    run = configure_model_after_split(module, skip_first=True)
    module.configure_model()  # Lightning's call, before the split: nothing happens
    assert calls == [] and run is not None
    run()
    assert calls == [module] and "configure_model" not in vars(module)
    run = configure_model_after_split(module, skip_first=False)
    module.configure_model()
    assert run is not None and calls == [module, module]
    assert configure_model_after_split(L.LightningModule(), skip_first=True) is None


def test_a_split_made_before_the_pipelines_is_refused_naming_the_fix(tensor_mesh):
    module = SplitMLP()
    parallelize_module(module.backbone, tensor_mesh, PLAN)
    with pytest.raises(ValueError, match=r"split backbone\.0\.0\.weight, .* before the pipeline split its backbone"):
        TensorSplit(module, None, "stage 0")


@pytest.fixture
def tensor_mesh():
    """A one-process ``tensor_parallel`` mesh (a one-process gloo group): DTensors of one shard."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Topology(1, 1, tensor_parallel_size=1).mesh("cpu")["data_parallel"]
    finally:
        dist.destroy_process_group()


def test_a_split_of_a_layer_the_stage_does_not_hold_is_refused_naming_it(tensor_mesh):
    """Layers 2 and 3 are another stage's (on the meta device); splitting layer 3 through a reference the module
    kept is refused, naming its parameters and the fix."""
    module = SplitMLP()
    every = list(module.backbone)  # what the module saw before the split
    for layer in every[2:]:
        layer.to("meta")

    def configure_model():
        parallelize_module(module.backbone[0], tensor_mesh, BLOCK_PLAN)
        parallelize_module(every[3], tensor_mesh, BLOCK_PLAN)

    with pytest.raises(ValueError, match=r"split backbone\.3\.0\.weight, .* on stage 0, which does not hold it"):
        TensorSplit(module, configure_model, "stage 0")


def test_a_module_leaves_the_split_plain_with_its_values(tensor_mesh):
    """After the run, every split parameter is a plain parameter of its whole value again and the input and output
    conversions ``parallelize_module`` hooked on are gone (the user's own hooks stay): the module computes as before."""
    module = SplitMLP()
    x = torch.randn(5, 16)
    before = module.head(module.backbone(x))
    user_hook = module.backbone[0].register_forward_hook(lambda *_: None)
    split = TensorSplit(module, lambda: parallelize_module(module.backbone, tensor_mesh, PLAN), "stage 0")
    assert isinstance(module.backbone[0][0].weight, DTensor)
    split.undo()
    assert not any(isinstance(p, DTensor) for p in module.parameters())
    assert all(isinstance(p, nn.Parameter) for p in module.parameters())
    assert list(module.backbone[0]._forward_hooks) == [user_hook.id]
    assert not module.backbone[0][0]._forward_pre_hooks and not module.backbone[0][2]._forward_hooks
    torch.testing.assert_close(module.head(module.backbone(x)), before, atol=0, rtol=0)


def test_a_stage_split_into_nothing_is_warned_about(tensor_mesh):
    with pytest.warns(UserWarning, match="split no parameter of stage 1: each of its tensor ranks holds"):
        TensorSplit(SplitMLP(), None, "stage 1")


@pytest.fixture
def tensor_ranks():
    """A one-process mesh whose only dimension is ``"tensor_parallel"``, as a module's ``device_mesh`` has it."""
    from torch.distributed.device_mesh import init_device_mesh

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(base_model_tp_plan={}), "LlamaForCausalLM declares no tensor plan .* Use tensor_parallel_size=1"),
        (
            dict(base_model_tp_plan={"layers.*.mlp.up_proj": "packed_colwise"}),
            "model.layers.\\*.mlp.up_proj is declared 'packed_colwise' .* a style GPipeStrategy does not split with",
        ),
    ],
)
def test_a_hugging_face_model_whose_tensor_plan_cannot_split_it_is_refused_naming_why(tensor_ranks, change, message):
    pytest.importorskip("transformers")
    from conftest import hf_worker

    import lightning_gpipe.hf as hf
    from lightning_gpipe.hf.tensor_plan import split_stage
    from lightning_gpipe.lightning._lightning import give_device_mesh

    config = hf_worker().initial_model("llama").config
    for key, value in change.items():
        setattr(config, key, value)
    module = hf.CausalLM(config=config, attn_implementation="eager", self_check=False)
    module.configure_model()
    give_device_mesh(module, tensor_ranks)
    with pytest.raises(hf.UnsupportedModelError, match=message):
        split_stage(module)


def test_a_hugging_face_model_splits_its_projections_and_keeps_its_tied_head_whole(tensor_ranks):
    """The tiny Llama's attention and MLP projections become DTensors; its head, tied to the embeddings, stays whole;
    a second call splits nothing more."""
    pytest.importorskip("transformers")
    from conftest import hf_worker

    import lightning_gpipe.hf as hf
    from lightning_gpipe.lightning._lightning import give_device_mesh

    module = hf.CausalLM(config=hf_worker().initial_model("llama").config, attn_implementation="eager")
    module.configure_model()
    planned = layer_splits(module, "backbone", 2)  # what the planner reads of the same plan, before the split
    layers = list(module.backbone)
    assert planned[0].divided_bytes == 0 and planned[-1].divided_bytes == 0  # the tied embedding and head: whole
    for layer, split in list(zip(layers, planned))[1:-2]:  # the decoder layers: all but their norms divided
        assert split.output_divided is False and split.forward_collectives == 2  # o_proj and down_proj
        norms = sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if "norm" in name)
        assert split.divided_bytes == sum(p.numel() * p.element_size() for p in layer.parameters()) - norms
    give_device_mesh(module, tensor_ranks)
    module.configure_model()  # as GPipeStrategy calls it again after the split
    split = {name for name, p in module.named_parameters() if isinstance(p, DTensor)}
    assert any("self_attn.q_proj" in name for name in split)
    assert any("down_proj" in name for name in split) and not any("lm_head" in name for name in split)
    module.configure_model()
    assert {name for name, p in module.named_parameters() if isinstance(p, DTensor)} == split


def test_the_causal_lm_examples_tensor_parallel_config_makes_2_stages_of_2_tensor_ranks(monkeypatch):
    """examples/causal_lm/configs/tensor_parallel.yaml parses with the example's command line into a GPipeStrategy of
    2 stages x 2 tensor ranks on 4 processes, reading the defaults' batches (one replica)."""
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    monkeypatch.setattr(sys, "argv", ["train.py"])
    from causal_lm.train import main

    cli = main(["--config", str(examples / "causal_lm" / "configs" / "tensor_parallel.yaml")], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, GPipeStrategy) and cli.trainer.num_devices == 4
    assert (strategy.config.pipeline_parallel_size, strategy.config.tensor_parallel_size) == (2, 2)
    assert cli.datamodule.batch_size == main([], run=False).datamodule.batch_size


@pytest.fixture
def rank_zero_of_two():
    """Global rank 0 of a world of 2 on torch's fake process group (collectives move nothing): one process holds the
    shards rank 0 of 2 would, as ``parallelize_module`` makes them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tensor_parallel",))
    finally:
        dist.destroy_process_group()


def _block_costs(module: SplitMLP, rows: int) -> list:
    """Injected costs of ``module``'s 4 blocks at ``rows`` rows (no clock): their parameter bytes, the block's input
    saved whole by the first Linear, its 4x wider hidden layer saved once (the ReLU's output, the second Linear's
    input), and its output."""
    from lightning_gpipe.planning import LayerCost

    row, hidden = 4 * 16 * rows, 4 * 64 * rows
    return [
        LayerCost(1e-3, 2e-3, row + hidden, row, sum(p.numel() * 4 for p in block.parameters()), row, 0)
        for block in module.backbone
    ]


def test_the_planned_state_of_a_tensor_parallel_stage_is_what_its_rank_holds_after_the_split(rank_zero_of_two):
    """pp=2 x tp=2 on the column/row MLP: each process's planned parameters, gradients and AdamW state are the bytes
    of the local shards ``parallelize_module`` leaves rank 0 of its stage (the row-parallel biases whole); its
    activations and its output fall where the split divides them; at T=1 the stage holds its blocks whole."""
    from lightning_gpipe.planning import CostModel, PipelinePlan, ProfiledCosts, per_tensor_rank, predict

    free = CostModel(0.0, float("inf"), 0.0, 0.0, float("inf"), float("inf"), 0.0, copy_bandwidth=float("inf"))
    module = SplitMLP()
    costs = ProfiledCosts((8, 8), _block_costs(module, 8), _block_costs(module, 8), 32, 4 * 16 * 32)
    whole = [sum(p.numel() * 4 for block in module.backbone[s : s + 2] for p in block.parameters()) for s in (0, 2)]
    ranked = per_tensor_rank(costs, layer_splits(module, "backbone", 2, PLAN), 2, free)
    plan = PipelinePlan(2, 1, 4, "never", "gpipe", (2, 2), tensor_parallel_size=2)
    split, unsplit = (predict(plan, c, free, 2, 2**40).memory for c in (ranked, costs))
    parallelize_module(module.backbone, rank_zero_of_two, PLAN)
    local = [
        sum(p.to_local().numel() * 4 for block in module.backbone[s : s + 2] for p in block.parameters())
        for s in (0, 2)
    ]
    assert local[0] < 0.55 * whole[0]  # the shards are real
    for k in (0, 1):
        assert (split[k].parameters, split[k].gradients, split[k].optimizer) == (local[k], local[k], 2 * local[k])
        assert (unsplit[k].parameters, unsplit[k].optimizer) == (whole[k], 2 * whole[k])
        assert split[k].activations < 0.65 * unsplit[k].activations  # the hidden layers, divided
    assert ranked.large[0].output_bytes == costs.large[0].output_bytes  # a row-parallel output is whole


def test_the_planner_plans_tensor_parallel_meshes_per_process_and_names_them():
    """With T = 2 on 4 processes the planner tries K x D over 2 pipelines only; a limit one process of a stage on 2
    pipelines cannot fit without T fits with it, and the plan's options carry T. Without a declared split or a plan
    for ``configure_model``'s, ``plan()`` is refused naming the fix."""
    from lightning_gpipe import plan
    from lightning_gpipe.planning import Constraints, CostModel, ProfiledCosts, per_tensor_rank, search

    module = SplitMLP()
    costs = ProfiledCosts((8, 2), _block_costs(module, 8), _block_costs(module, 2), 32, 4 * 16 * 32)
    ranked = per_tensor_rank(costs, layer_splits(module, "backbone", 2, PLAN), 2)
    report = search(4, ranked, 2**40, 2, CostModel(), Constraints(micro_batches=4, tensor_parallel_size=2))
    assert {(p.plan.pipeline_parallel_size, p.plan.data_parallel_size) for p in report.predictions} <= {(1, 2), (2, 1)}
    assert report.chosen.plan.options()["tensor_parallel_size"] == 2 and "x2" in report.table()
    two = Constraints(pipeline_parallel_size=2, data_parallel_size=1, micro_batches=4, checkpoint="never")
    limit = 0.9 * search(2, costs, 2**40, 2, CostModel(), two).smallest_fitting_limit
    with pytest.raises(ValueError, match="No pipeline plan fits"):
        search(2, costs, limit, 2, CostModel(), two)
    assert search(4, ranked, limit, 2, CostModel(), dataclasses.replace(two, tensor_parallel_size=2)).chosen.fits
    with pytest.raises(ValueError, match=r"cannot tell how SplitMLP.configure_model splits .* tensor_plan=PLAN"):
        plan(SplitMLP(), 4, 2**30, example_batch=(torch.randn(8, 16), None), tensor_parallel_size=2)


def test_a_tied_parameter_split_on_one_of_its_stages_only_is_refused_before_its_copies_sync(
    rank_zero_of_two, monkeypatch
):
    """An embedding tied to a head that the user's plan splits by output columns while the embedding stays whole: each
    holder learns the other's layout and refuses before the first broadcast of the tie, naming it and the fix."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    from lightning_gpipe.engine import ties as ties_module
    from lightning_gpipe.engine.ties import Tie, TiedParameters, check_layouts, layout
    from lightning_gpipe.faults import Job

    embedding, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = embedding.weight
    parallelize_module(head, rank_zero_of_two, ColwiseParallel())
    split = layout(head.weight)
    assert layout(embedding.weight) == "whole" and split == "split as (Shard(dim=0),) over 2 ranks"
    tie = Tie(("backbone.0.weight", "head.weight"), (0, 1), (0, 1))
    check_layouts(tie, [split, split])  # alike: nothing to refuse
    message = r"backbone\.0\.weight = head\.weight, tied across stages 0, 1, is laid out differently .*\(stage 0: whole"
    with pytest.raises(ValueError, match=message + r".* ColwiseParallel, and the Embedding .* RowwiseParallel"):
        check_layouts(tie, ["whole", split])
    module = nn.Module()
    module.backbone = nn.Sequential(embedding)
    held = TiedParameters([tie], module, Topology(2, 2), rank=0, job=Job())
    sent = []
    monkeypatch.setattr(
        ties_module.waiting, "broadcast_object", lambda job, obj, src, group: obj if src == 0 else split
    )
    monkeypatch.setattr(ties_module.waiting, "broadcast", lambda *args: sent.append(args))
    with pytest.raises(ValueError, match=message):
        held.synchronize()
    assert sent == []


class DeclaredSplitMLP(SplitMLP):
    """:class:`SplitMLP` declaring its split to the planner (as the Hugging Face modules declare transformers')."""

    def tensor_targets(self, size):
        return [[(block[0], BLOCK_PLAN["0"]), (block[2], BLOCK_PLAN["2"])] for block in self.backbone]


def _planned(config, whole=False):
    """``plan="auto"``'s plan for 2 stages x 2 replicas x 2 tensor ranks of :class:`DeclaredSplitMLP`, on injected
    costs (no clock), as every process gets it (``share`` a copy)."""
    from lightning_gpipe.lightning.planner import plan_for_strategy
    from lightning_gpipe.planning import ProfiledCosts

    module = DeclaredSplitMLP()
    costs = ProfiledCosts((8, 2), _block_costs(module, 8), _block_costs(module, 2), 32, 4 * 16 * 32)
    mesh, device = (2, 2), torch.device("cpu")
    return plan_for_strategy(module, "backbone", config, mesh, device, lambda: costs, lambda x: x, whole).chosen.plan


def test_plan_auto_with_replicas_of_tensor_parallel_stages_plans_a_sharding_the_strategy_takes():
    """``plan="auto"`` at D = 2, T = 2 without ``sharding_strategy``: the launch takes the mesh (the sharding is the
    planner's), and the planner chooses FSDP2, which the replicas' check then accepts."""
    options = dict(plan="auto", memory_limit=2**40, tensor_parallel_size=2, pipeline_parallel_size=2)
    strategy = GPipeStrategy(data_parallel_size=2, **options)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=8, logger=False, enable_checkpointing=False)
    assert trainer.strategy.topology.data_parallel_size == 2
    chosen = _planned(strategy.config)
    assert chosen.sharding_strategy == "SHARD_GRAD_OP" and chosen.tensor_parallel_size == 2
    check_tensor_parallel_replicas(dataclasses.replace(strategy.config, sharding_strategy=chosen.sharding_strategy), 2)
    with pytest.raises(ValueError, match="DDP does not take the tensor-parallel"):  # NO_SHARD given: still refused
        check_tensor_parallel_replicas(PipelineConfig(sharding_strategy="NO_SHARD", **options), 2)


def test_a_gradient_scaler_with_tensor_parallelism_is_refused_before_any_process_starts_and_never_planned():
    """``precision="16-mixed"`` with a gradient scaler and T > 1 is refused when the Trainer configures the launch, for
    any sharding, naming the fix; the planner refuses it alike rather than plan DDP (``"NO_SHARD"``) for it."""
    from lightning.pytorch.plugins import MixedPrecision

    message = r"tensor_parallel_size=2\) with precision='16-mixed': .* Use precision='bf16-mixed' \(no scaler\)"
    for sharding in (None, "FULL_SHARD"):
        strategy = GPipeStrategy(tensor_parallel_size=2, sharding_strategy=sharding)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
        with pytest.raises(ValueError, match=message):
            L.Trainer(strategy=strategy, accelerator="cpu", devices=4, plugins=[plugin], logger=False)
    config = PipelineConfig(plan="auto", memory_limit=2**40, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=message):
        _planned(config, whole=True)


@pytest.mark.parametrize("tensor", [1, 2])
def test_the_resplit_check_keeps_a_tensor_parallel_split_saying_why(tensor, monkeypatch, caplog):
    """``balance="time"``'s check after the first steps, on injected busy times (no clock) that re-split 2 stages of
    equal profiled layers where the second stage measured 4x the first: with T = 1 the layers move; with T = 2 the run
    keeps its split, and its record and its line say why."""
    from types import SimpleNamespace

    from lightning_gpipe.lightning import resplit
    from lightning_gpipe.planning import LayerCost

    strategy = GPipeStrategy(balance="time", chunks=4, checkpoint="never", tensor_parallel_size=tensor)
    strategy.parallel_devices = [torch.device("cpu")] * 2 * tensor
    strategy.layer_costs = [LayerCost(1e-3, 2e-3)] * 4
    busy = {0: 12e-3, 1: 48e-3}  # per stage: the profile predicts 12e-3 each
    parts = [(busy[strategy.topology.stage_of(r)], ["0", "1"], False) for r in range(2 * tensor)]
    monkeypatch.setattr(resplit.waiting, "all_gather_object", lambda job, mine: parts)
    moved = []
    monkeypatch.setattr(resplit, "move_layers", lambda strategy, run, process, balance: moved.append(balance))
    check = resplit.Resplit(warmup=0, steps=1)
    assert check.stepped(busy[0])
    with caplog.at_level("INFO"):
        strategy._check_split(check, SimpleNamespace(partition=nn.Sequential(), ties=SimpleNamespace(held=False)))
    if tensor == 1:
        assert moved == [check.record["resplit"]] and check.record["resplit"][0] > 2
        return
    assert moved == [] and check.record["resplit"] is None
    assert check.record["refused"].startswith("tensor-parallel stages move no layers yet (a moved layer's shards")
    assert "GPipeStrategy keeps balance=[2, 2] whatever its stages' measured times: tensor-parallel" in caplog.text


def test_a_split_embeddings_whole_gradient_is_summed_over_its_tie_as_its_weight_is_split(rank_zero_of_two, monkeypatch):
    """An embedding split by rows computes its weight's gradient whole (``Replicate``) on each tensor rank; the tie's
    sum takes this rank's rows, laid out as the weight, so every holder all-reduces parts of one shape (the head's
    gradient, split by output columns, has them)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from lightning_gpipe.engine import ties as ties_module
    from lightning_gpipe.engine.ties import Tie, TiedParameters
    from lightning_gpipe.faults import Job

    module = nn.Module()
    module.backbone = nn.Sequential(nn.Embedding(8, 4))
    parallelize_module(module.backbone, rank_zero_of_two, {"0": RowwiseParallel(input_layouts=Replicate())})
    module.backbone(torch.tensor([1, 6, 6])).sum().backward()
    weight = module.backbone[0].weight
    assert weight.grad.placements == (Replicate(),)
    whole = weight.grad.full_tensor()
    tie = Tie(("backbone.0.weight", "head.weight"), (0, 1), (0, 1))
    summed = []
    monkeypatch.setattr(ties_module.waiting, "all_reduce", lambda job, flat, group: summed.append(flat.numel()))
    TiedParameters([tie], module, Topology(2, 2), rank=0, job=Job()).reduce_grads()
    assert summed == [weight.to_local().numel() + 1]
    assert weight.grad.placements == (Shard(0),)
    torch.testing.assert_close(weight.grad.to_local(), whole[:4], atol=0, rtol=0)
