"""Models that are not a plain chain: skip connections across stages (lightning_gpipe.skip) and parameters tied
across stages (lightning_gpipe.ties). The 3-stage runs share one worker launch (tests/workers/skip_ties.py)."""

import copy
import re

import lightning as L
import pytest
import torch
from conftest import assert_states_close, one_stage_pipeline, shared_run
from test_translation import TINY, one_thread, predict_data
from models import FEATURES, trainer_kwargs
from nonchain import Pop, SkipNet, Stash, TiedNet, dense, fit_nonchain, fit_tied_translation, skip_loader
from torch import nn

import lightning_gpipe
from lightning_gpipe.balance import profile_layers
from lightning_gpipe.optimization import clip_grad_norm_
from lightning_gpipe.partition import Split
from lightning_gpipe.skip import Namespace, SkipLayout, pop, skippable, stash, verify_skippables
from lightning_gpipe.ties import find_ties
from translation.module import TranslationModule


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


THREE_STAGES = shared_run("skip_ties.py", "--devices=3", devices=3, timeout=400)


@pytest.fixture(scope="module")
def three_stages():
    return THREE_STAGES()


@pytest.fixture(scope="module")
def one_device():
    """The state dicts single-device Lightning trains: SkipNet, TiedNet, and TiedNet clipped by norm."""
    return {
        "skip": fit_nonchain(SkipNet).lightning_module.state_dict(),
        "tied": fit_nonchain(TiedNet).lightning_module.state_dict(),
        "tied_clipped": fit_nonchain(TiedNet, gradient_clip_val=0.05).lightning_module.state_dict(),
    }


@pytest.mark.parametrize(
    ("run", "reference"),
    [
        ("skip_always", "skip"),
        ("skip_except_last_deferred", "skip"),
        ("skip_1f1b_never", "skip"),
        ("skip_1f1b_always", "skip"),
        ("skip_neighbour_1f1b", "skip"),
        ("tied_except_last", "tied"),
        ("tied_1f1b", "tied"),
        ("tied_clipped", "tied_clipped"),
    ],
)
def test_three_stages_train_like_one_device(three_stages, one_device, run, reference):
    assert_states_close(torch.load(three_stages / f"{run}.pt"), one_device[reference])


def test_skip_predictions_equal_one_device_on_every_stage(three_stages):
    module = SkipNet()
    module.load_state_dict(torch.load(three_stages / "skip_neighbour_1f1b.pt"))
    expected = [module.predict_step(batch, i).detach() for i, batch in enumerate(skip_loader())]
    for rank in range(3):
        for got, want in zip(torch.load(three_stages / f"skip_predictions_rank{rank}.pt"), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_middle_stage_never_receives_the_skip(three_stages):
    skip_tag, rows = 1, [7, 7, 6, 7, 7, 6, 4, 4, 4] * 2  # 6 steps of 3 micro-batches: batches of 20, 20, 12 rows
    micro_batches = len(rows)
    middle = torch.load(three_stages / "receives_rank1.pt")
    assert all(tag != skip_tag for _, tag, _ in middle)
    from_first = [shape for src, _, shape in middle if src == 0 and len(shape) == 2]
    assert len(from_first) == micro_batches  # one tensor a micro-batch: the activation, never the skip
    last = torch.load(three_stages / "receives_rank2.pt")
    skips = [shape for src, tag, shape in last if src == 0 and tag == skip_tag and len(shape) == 2]
    assert skips == [(n, FEATURES) for n in rows]  # straight from the first stage, on the skip tag


def test_tied_model_is_tied_again_and_its_checkpoint_loads_without_the_strategy(three_stages, one_device):
    assert (three_stages / "tied_again.txt").read_text() == "True"
    checkpoint = torch.load(three_stages / "tied.ckpt", weights_only=False)
    expected = one_device["tied"]
    assert_states_close(checkpoint["state_dict"], expected)  # one entry per name
    module = TiedNet()
    module.load_state_dict(checkpoint["state_dict"])
    assert module.head.weight is module.backbone[0].weight
    names = {key.split(".", 1)[1].rsplit(".", 1)[0] for key in checkpoint["optimizer_states"][0] if key[:6] == "state."}
    assert names == set(expected)  # Adam's state of every name, tied copies included


def test_tied_translation_trains_and_decodes_like_one_device(three_stages):
    with one_thread():
        expected = fit_tied_translation().state_dict()
    state = torch.load(three_stages / "translation.pt")
    d = TINY["d_model"]
    for name in [name for name in expected if name.endswith("in_proj_bias")]:
        # the key bias has no gradient but rounding noise (softmax ignores a shift), which Adam makes a full step
        state[name], expected[name] = state[name].clone(), expected[name].clone()
        state[name][d : 2 * d] = expected[name][d : 2 * d] = 0
    assert_states_close(state, expected)
    torch.testing.assert_close(state["backbone.6.projection.weight"], state["backbone.0.tokens.weight"], rtol=0, atol=0)
    module = TranslationModule(**TINY, tie_embeddings=True)
    module.load_state_dict(state)
    module.eval()
    translations = [sentence for i, batch in enumerate(predict_data()) for sentence in module.predict_step(batch, i)]
    for rank in range(3):
        got = [sentence for batch in torch.load(three_stages / f"translations_rank{rank}.pt") for sentence in batch]
        assert got == translations, f"rank {rank}"
