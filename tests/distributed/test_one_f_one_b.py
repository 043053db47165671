"""GPipeStrategy(schedule="1f1b") on stage processes: one launch of tests/workers/one_f_one_b.py with K = 2 against
single-device Lightning (K = 3 and 4: tests/distributed/test_equivalence.py)."""

import json

import pytest
import torch
from conftest import assert_states_close, shared_run
from lightning.pytorch.plugins import MixedPrecision
from rowwise import WatchedNet, fit_batches

TWO_STAGES = shared_run("one_f_one_b.py", "--devices=2", devices=2)


@pytest.fixture(scope="module")
def runs():
    """The output directory of the 2-stage worker."""
    return TWO_STAGES()


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("M1_always", {}),  # M = 1 < K
        ("M3_except_last", {}),  # uneven micro-batches
        ("M8_never", {}),  # M >= K
        ("resume", {}),  # from a full checkpoint written at step 3
        ("clip_norm", dict(gradient_clip_val=0.05)),
        ("accumulate", dict(accumulate_grad_batches=2)),
        ("deferred_weights", {}),  # with the zero-bubble B/W split (defer_weight_grad=True)
        ("zb_h1_M8_never", {}),  # schedule="zb-h1": stage 1 runs each W one micro-batch after its B
        ("zb_h1_M3_always", {}),  # and with re-materialization
        ("offload_M8_never", {}),  # offload="activations": saved activations wait in host memory
        ("offload_M3_except_last", {}),  # stage 0 offloads the last micro-batch, the others are re-materialized
        ("offload_gpipe_M8_never", {}),  # under fill-drain
        ("offload_zb_h1_M8_never", {}),  # and with the B/W split: W unpacks the prefetched tensors again
    ],
)
def test_1f1b_equals_one_device(runs, name, overrides, reference_state):
    expected = fit_batches(**overrides).lightning_module.state_dict() if overrides else reference_state
    assert_states_close(torch.load(runs / f"{name}.pt"), expected)


def test_offload_moved_activations_on_the_stages_whose_backward_waits(runs):
    """On a CPU nothing leaves host memory, but the hooks ran: stage 0 moved every configuration's activations; stage
    1 only fill-drain's (under 1F1B and ZB-H1 its backward follows each forward at once)."""
    first, last = (json.loads((runs / f"offload_rank{r}.json").read_text()) for r in range(2))
    assert set(first) == {
        "offload_M8_never",
        "offload_M3_except_last",
        "offload_gpipe_M8_never",
        "offload_zb_h1_M8_never",
    }
    assert all(moved > 0 for moved in first.values())
    assert set(last) == {"offload_gpipe_M8_never"} and last["offload_gpipe_M8_never"] > 0


@pytest.mark.parametrize("name, scale", [("fp16", 2.0**16), ("fp16_overflow", 2.0**24)])
def test_1f1b_16_mixed_scales_and_skips_like_one_device(runs, name, scale):
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    trainer = fit_batches(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert (scaler.get_scale() < scale) == (name == "fp16_overflow")  # its steps overflowed and were skipped
    scales = [json.loads((runs / f"{name}_rank{r}.json").read_text())["scale"] for r in range(2)]
    assert scales == [scaler.get_scale()] * 2
    assert_states_close(torch.load(runs / f"{name}.pt"), trainer.lightning_module.state_dict(), atol=1e-3)


def test_1f1b_hooks_and_logs_see_what_one_device_sees(runs):
    module = fit_batches(module=WatchedNet).lightning_module
    assert_states_close(torch.load(runs / "watched.pt"), module.state_dict())
    first, last = (json.loads((runs / f"watched_rank{r}.json").read_text()) for r in range(2))
    assert len(last) == len(first) == len(module.seen) == 6
    assert [step for step, seen in enumerate(module.seen) if "wide" in seen] == [1, 4]  # batches 1 of 3 per epoch
    for step, (got, relayed, expected) in enumerate(zip(last, first, module.seen)):
        assert got["grad_before"] is expected["grad_before"] is False  # the step's gradients come in backward
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["grad_after"] == pytest.approx(expected["grad_after"], abs=1e-5)
        assert got["logits_rows"] == expected["logits_rows"]
        assert ("wide" in got) == ("wide" in relayed) == ("wide" in expected)
        if "wide" in expected:  # relayed apart from the agreement's region: larger than it
            assert got["wide"] == pytest.approx(expected["wide"], rel=1e-5)
            assert relayed["wide"] == got["wide"]
        for metrics in (got["metrics"], relayed["metrics"]):
            assert metrics.keys() == expected["metrics"].keys()
            for key, value in expected["metrics"].items():
                if key == "rows":  # not a row mean: the row-weighted mean of the micro-batches' row counts
                    sizes = [7, 7, 6] if value == 20 else [4, 4, 4]
                    value = sum(n * n for n in sizes) / sum(sizes)
                assert metrics[key] == pytest.approx(value, abs=1e-5), (step, key)


def test_1f1b_refuses_a_batch_it_cannot_split_on_every_stage(runs):
    for rank in range(2):
        message = (runs / f"unsplittable_rank{rank}.txt").read_text()
        assert "every tensor of the batch needs the batch's rows in dim 0" in message
        assert "[(20, 16), (20,), (3,)]" in message and "schedule='gpipe'" in message
