"""Models that are not a plain chain: skip connections across stages (lightning_gpipe.engine.skip) and parameters tied
across stages (lightning_gpipe.engine.ties), checked in this process (the 3-stage runs:
tests/distributed/test_skip_ties.py)."""

import copy
import re

import lightning as L
import pytest
import torch
from conftest import one_stage_pipeline
from models import FEATURES, trainer_kwargs
from nonchain import Pop, SkipNet, Stash, TiedNet, dense, skip_loader
from torch import nn

import lightning_gpipe
from lightning_gpipe.engine import ties as ties_module
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.skip import Namespace, SkipLayout, pop, skippable, stash, verify_skippables
from lightning_gpipe.engine.ties import TiedParameters, find_ties
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.optimization import clip_grad_norm_
from lightning_gpipe.planning.balance import profile_layers


def test_skippable_backbone_runs_unchanged_on_one_device_and_in_a_one_stage_pipeline():
    torch.manual_seed(0)
    module, x = SkipNet(), torch.randn(7, FEATURES)
    layers = module.backbone
    h0 = torch.tanh(layers[0].linear(x))
    h2 = torch.tanh(layers[2].linear(layers[1](h0)))
    by_hand = torch.tanh(layers[5].linear(layers[4](torch.tanh(layers[3].linear(h2)) + h2))) + h0
    torch.testing.assert_close(layers(x), by_hand, rtol=0, atol=0)
    by_hand.sum().backward()
    expected = {name: p.grad.clone() for name, p in layers.named_parameters()}
    module.zero_grad()
    schedule = one_stage_pipeline(module, chunks=3, checkpoint="always")  # micro-batches, recomputed skips
    module.backbone(x).sum().backward()
    schedule.backward()
    for name, p in module.backbone.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        (lambda: [dense(), Pop()], "layer 1 pops 'skip' but no earlier layer stashes it"),
        (lambda: [Pop(), Stash()], "layer 0 pops 'skip' but no earlier layer stashes it"),
        (lambda: [Stash(), Stash(), Pop()], "layer 1 stashes 'skip', already stashed by layer 0; isolate each"),
        (lambda: [Stash(), Pop(), Pop()], "layer 2 pops 'skip', already popped by layer 1; isolate each"),
        (lambda: [Stash(), dense()], "layer 0 stashes 'skip' but no later layer pops it"),
        (lambda: [nn.Sequential(Stash()), Pop()], "layer 0 holds the skippable `0` (Stash) inside it"),
    ],
)
def test_skips_that_do_not_pair_up_are_named(layers, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        verify_skippables(nn.Sequential(*layers()))


def test_namespaces_keep_same_named_skips_apart_and_routes_cross_stages_only():
    ns = Namespace()
    backbone = nn.Sequential(Stash(), Stash().isolate(ns), dense(), Pop().isolate(ns), Pop())
    layout = SkipLayout(backbone, [2, 2, 1])
    assert [(r.src, r.dst, r.key) for r in layout.routes] == [(0, 2, (None, "skip")), (0, 1, (ns, "skip"))]
    assert layout.outgoing(0) == {1: [(ns, "skip")], 2: [(None, "skip")]}
    assert layout.incoming(2) == {0: [(None, "skip")]} and layout.incoming(1) == {0: [(ns, "skip")]}
    with pytest.raises(ValueError, match="isolate"):
        Stash().isolate(ns, only=["other"])


def test_a_forward_that_breaks_its_declaration_is_named():
    @skippable(stash=["a", "b"])
    class Forgets(nn.Module):
        def forward(self, x):
            yield stash("a", x)
            return x

    @skippable(pop=["a"])
    class Undeclared(nn.Module):
        def forward(self, x):
            yield pop("b")
            return x

    with pytest.raises(RuntimeError, match=r"declares stash=\['a', 'b'\] but its forward did not `yield stash"):
        Forgets()(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"yielded pop\('b'\) but declares pop=\['a'\]"):
        Undeclared()(torch.ones(1))


def test_the_strategy_refuses_unpaired_skips_before_any_step():
    class Unpaired(SkipNet):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(Stash(), dense())

    trainer = L.Trainer(strategy=lightning_gpipe.GPipeStrategy(), devices=1, max_steps=1, **trainer_kwargs())
    with pytest.raises(ValueError, match="layer 0 stashes 'skip' but no later layer pops it"):
        trainer.fit(Unpaired(), skip_loader())
    assert trainer.global_step == 0


def test_profiling_hands_each_stash_to_its_pop():
    backbone = SkipNet().backbone
    costs = profile_layers(backbone, torch.randn(4, FEATURES), repeats=1, warmup=0)
    assert len(costs) == len(backbone) and all(cost.backward > 0 for cost in costs)
    assert copy.deepcopy(backbone)[2].namespaced("skip") == backbone[2].namespaced("skip")  # a copy keeps namespaces


def test_ties_are_found_and_each_stage_keeps_its_shared_objects():
    ties = find_ties(TiedNet(), "backbone", [3, 2, 2])
    assert [(tie.names, tie.stages) for tie in ties] == [
        (("backbone.0.weight", "head.weight"), (0, 2)),
        (("backbone.1.weight", "backbone.5.weight"), (0, 2)),
        (("backbone.1.bias", "backbone.5.bias"), (0, 2)),
    ]
    assert find_ties(TiedNet(), "backbone", [7]) == []  # one stage: nothing to keep in step
    module = TiedNet()
    split = Split(module, "backbone", [3, 2, 2], stage_index=0)
    shared = split.partition._modules["1"]  # also layer 5, on stage 2: must not have gone to the meta device
    assert not shared.weight.is_meta and split.sequential[5] is shared
    split.undo(TiedNet().state_dict())
    assert module.head.weight is module.backbone[0].weight and not module.head.weight.is_meta
    last = TiedNet()
    Split(last, "backbone", [3, 2, 2], stage_index=2).undo()  # as on a stage without the whole state after fit
    assert last.head.weight is last.backbone[0].weight and not last.head.weight.is_meta  # the stage's trained copy


def test_clipping_leaves_uncounted_copies_out_of_the_norm():
    counted, copy = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    counted.grad, copy.grad = torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])
    total = clip_grad_norm_([counted, copy], max_norm=1.0, uncounted=[copy], job=None)
    assert total.item() == pytest.approx(5.0)
    torch.testing.assert_close(copy.grad, torch.tensor([0.6, 0.8]))


def test_virtual_stages_split_into_chunks_and_refuse_a_skip_within_one_stage():
    import torch as _torch

    from lightning_gpipe.engine.channels import _Wiring
    from lightning_gpipe.engine.events import TrackingRecorder
    from lightning_gpipe.engine.pipeline import StageSpec
    from lightning_gpipe.engine.topology import Topology
    from lightning_gpipe.engine.transfer import Turn
    from lightning_gpipe.faults.job import Job

    module = nn.Module()
    module.backbone = nn.Sequential(Stash(), dense(), Pop(), dense())
    topology = Topology(2, 2, virtual_stages=2)
    split = Split(module, "backbone", [1, 1, 1, 1], stage_index=0, num_stages=2)
    assert [list(chunk._modules) for chunk in split.model_chunks] == [["0"], ["2"]]  # virtual stages 0 and 2
    assert list(module.backbone._modules) == ["0", "2"]  # one module under the original names
    layout, job, turn = SkipLayout(split.sequential, [1, 1, 1, 1]), Job(), Turn()
    # a skip between two chunks of one stage goes through a turn both chunks share, not a transfer to itself
    spec = StageSpec(topology, 0, _torch.device("cpu"), balance=[1, 1, 1, 1])
    wiring = _Wiring(spec, layout, job, groups={}, turns={("skip", 0, 2): turn})
    _, stashing = wiring._model_chunk_links(0, TrackingRecorder(job.position))
    _, popping = wiring._model_chunk_links(2, TrackingRecorder(job.position))
    stashed = {key: _torch.ones(3, FEATURES) for key in layout.outgoing(0)[2]}
    stashing.send(stashed, 0)
    received = popping.receive(training=True)
    assert received.keys() == stashed.keys() and all(t.requires_grad for t in received.values())
    assert all(received[key] is not stashed[key] for key in stashed)  # a copy, as a transfer delivers
    # a parameter two chunks of one stage use is one object there: no tie; across stages it is one
    shared = nn.Linear(FEATURES, FEATURES)
    tied = nn.Module()
    tied.backbone = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh())
    assert find_ties(tied, "backbone", [1, 1, 1, 1], num_stages=2) == []
    assert [t.stages for t in find_ties(tied, "backbone", [1, 1, 1, 1], num_stages=4)] == [(0, 2), (0, 2)]


def test_every_link_that_may_share_a_pair_of_ranks_has_a_process_group_of_its_own(monkeypatch):
    """NCCL matches one communicator's messages by order: each virtual link and each skip between two processes
    gets a group, created by every process in one order; a pipeline of one chunk per stage keeps its neighbour
    links on the default group."""
    from lightning_gpipe.engine import channels
    from lightning_gpipe.engine.topology import Topology

    created = []
    monkeypatch.setattr(channels.dist, "new_group", lambda ranks: created.append(tuple(ranks)) or len(created))
    backbone = nn.Sequential(Stash(), dense(), dense(), Pop())
    skips = SkipLayout(backbone, [1, 1, 1, 1])  # the skip goes from virtual stage 0 to 3
    # 2 replicas x 2 stages x 2 chunks: links 0-1, 1-2, 2-3 and the skip 0-3 of each replica
    groups = channels.link_groups(Topology(4, 2, virtual_stages=2), skips, rank=3)
    assert created == [(0, 1), (0, 1), (0, 1), (0, 1), (2, 3), (2, 3), (2, 3), (2, 3)]
    assert groups == {(1, 0, 1): 5, (1, 1, 2): 6, (1, 2, 3): 7, (1, 0, 3): 8}  # rank 3: stage 1 of replica 1
    created.clear()
    assert channels.link_groups(Topology(2, 2), SkipLayout(backbone, [2, 2]), rank=0) == {(0, 0, 1): 1}
    assert created == [(0, 1)]  # the skip only: the neighbour link stays on the default group


def test_each_trainable_tie_sums_its_gradients_once_and_a_frozen_tie_not_at_all(monkeypatch):
    reduced = []
    monkeypatch.setattr(ties_module.waiting, "all_reduce", lambda job, flat, group: reduced.append(flat.numel()))
    module = TiedNet()
    module.backbone[1].weight.requires_grad_(False)  # e.g. a frozen base weight under LoRA: no gradient to sum
    module.head(module.backbone(torch.tensor([[1, 2, 3]]))).sum().backward()
    held = TiedParameters(find_ties(module, "backbone", [3, 2, 2]), module, Topology(3, 3), rank=0, job=Job())
    held.reduce_grads()
    weight, bias = module.backbone[0].weight, module.backbone[1].bias
    assert reduced == [weight.numel() + 1, bias.numel() + 1]  # a gradient and its has-gradient count, per tie
