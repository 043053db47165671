"""Production training under GPipeStrategy equals single-device Lightning.

One 2-stage run of tests/workers/production.py covers global clipping, accumulation, bf16 and
16-mixed, meta-device initialisation, full and sharded checkpoints and resuming from them; a
3-stage run resumes from the 2-stage checkpoints (re-partitioning on load).
"""

import json

import lightning as L
import pytest
import torch
from conftest import assert_states_close, shared_run
from lightning.pytorch.plugins import MixedPrecision
from models import TupleNet, fit, fit_trainer, loader, trainer_kwargs

import lightning_gpipe

TWO_STAGES = shared_run("production.py", "--devices=2", devices=2, timeout=600, name="production")
RESUMED_ON_THREE = shared_run(
    "production.py", "--devices=3", "--resume-only", devices=3, name="production", output_of=2
)


@pytest.fixture(scope="module")
def runs():
    """The worker's output directory after a 2-stage run and a 3-stage resume from its checkpoints."""
    RESUMED_ON_THREE()
    return TWO_STAGES()


def _facts(runs, name, stages=2):
    return [json.loads((runs / f"{name}_rank{r}.json").read_text()) for r in range(stages)]


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("clip_norm", dict(gradient_clip_val=0.05)),
        ("clip_value", dict(gradient_clip_val=0.01, gradient_clip_algorithm="value")),
        ("accumulate", dict(accumulate_grad_batches=2)),
        ("sanity_check", dict(num_sanity_val_steps=2, val_check_interval=2)),
    ],
)
def test_matches_single_device(runs, name, overrides, reference_state):
    expected = fit(**overrides).state_dict()
    if name != "sanity_check":  # the setting changes training, so the comparison can fail
        with pytest.raises(AssertionError):
            assert_states_close(expected, reference_state)
    assert_states_close(torch.load(runs / f"{name}.pt"), expected)


def test_validate_matches_single_device(runs):
    L.seed_everything(1, verbose=False)
    (expected,) = L.Trainer(**trainer_kwargs()).validate(TupleNet(), loader(seed=1))
    (metrics,) = json.loads((runs / "validate.json").read_text())
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6)


def test_bf16_matches_single_device(runs):
    expected = fit(precision="bf16-mixed").state_dict()
    assert_states_close(torch.load(runs / "bf16.pt"), expected, atol=5e-3)


def test_fp16_stages_skip_and_scale_together(runs):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    trainer = fit_trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert scaler.get_scale() < 2.0**24  # overflowing steps were skipped and the scale backed off
    assert [facts["scale"] for facts in _facts(runs, "fp16")] == [scaler.get_scale()] * 2
    assert_states_close(torch.load(runs / "fp16.pt"), trainer.lightning_module.state_dict(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("name", ["configure_model", "empty_init"])
def test_each_stage_materialises_only_its_layers(runs, name):
    module = TupleNet()
    layers = list(module.backbone)
    split, _ = lightning_gpipe.solve([sum(p.numel() for p in layer.parameters()) for layer in layers], 2)
    expected = [
        sum(p.numel() for layer in layers[:split] for p in layer.parameters()),
        sum(p.numel() for layer in layers[split:] for p in layer.parameters())
        + sum(p.numel() for p in module.head.parameters()),
    ]
    facts = _facts(runs, name)
    assert [f["local_parameters"] for f in facts] == expected
    assert [f["meta_parameters"] for f in facts] == [0, 0]
    # after fit, rank 0 holds its own layers; the others stay on the meta device (the model was never whole)
    state = torch.load(runs / f"{name}.pt")
    assert state.keys() == module.state_dict().keys()
    own = {f"backbone.{i}." for i in range(split)}
    for key, value in state.items():
        assert value.is_meta != any(key.startswith(prefix) for prefix in own), key
        assert value.is_meta or torch.isfinite(value).all(), key


def test_full_checkpoint_loads_without_the_strategy(runs):
    expected = fit(max_steps=3).state_dict()
    loaded = TupleNet.load_from_checkpoint(runs / "full.ckpt")
    assert_states_close(loaded.state_dict(), expected)
    checkpoint = torch.load(runs / "full.ckpt", weights_only=False)
    (optimizer,) = checkpoint["optimizer_states"]
    assert {f"state.{name}.momentum_buffer" for name, _ in loaded.named_parameters()} <= optimizer.keys()


@pytest.mark.parametrize("kind", ["full", "sharded"])
@pytest.mark.parametrize("stages", [2, 3])
def test_resume_continues_exactly(runs, kind, stages, reference_state):
    assert_states_close(torch.load(runs / f"resume_{kind}_K{stages}.pt"), reference_state)


def test_sharded_checkpoint_is_a_directory_of_stage_shards(runs):
    path = runs / "sharded.ckpt"
    assert path.is_dir() and (path / "meta.pt").is_file()
    assert sorted(p.name for p in path.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
