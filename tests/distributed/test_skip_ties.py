"""Models that are not a plain chain on 3 stage processes, one worker launch (tests/workers/skip_ties.py): skip
connections and tied parameters train, predict and save like one device, and a skip travels straight to its stage."""

import pytest
import torch
from conftest import assert_states_close, shared_run
from models import FEATURES
from nonchain import SkipNet, TiedNet, fit_nonchain, fit_tied_translation, skip_loader
from tiny_translation import TINY, one_thread, predict_data
from translation.module import TranslationModule

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
        ("skip_zb_h1_always", "skip"),
        ("skip_neighbour_1f1b", "skip"),
        ("skip_interleaved_1f1b", "skip"),
        ("skip_zb_v", "skip"),
        ("tied_except_last", "tied"),
        ("tied_1f1b", "tied"),
        ("tied_zb_h1", "tied"),
        ("tied_clipped", "tied_clipped"),
        ("tied_interleaved_gpipe", "tied"),
        ("tied_zb_v", "tied"),
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
