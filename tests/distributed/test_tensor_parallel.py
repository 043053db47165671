"""Tensor parallelism inside the stages: (2 stages x 2 tensor ranks) trains like one device under fill-drain, 1F1B,
the B/W split and a V schedule, with global clipping over the split gradients; one stage of 2 tensor ranks with 2
replicas sharded by FSDP2 (2-D DTensors) too; each process holds about half of its stage's parameters; a full
checkpoint of a tensor-parallel run loads into the plain module and resumes without tensor parallelism and on
another mesh; an embedding tied to the head across the stages, both split alike, trains like one device; a Hugging
Face Llama split by its declared tensor plan, with and without LoRA, trains like one device; ``bf16-mixed`` on 2
stages x 2 tensor ranks trains like one device's ``bf16-mixed``.

Every run is tests/workers/tensor_parallel.py (one launch of 4 processes, shared with the suite's other 4-process
runs); the references are single-device Lightning on the same global batches (tests/tensor_parallel.py), and the
unmodified tiny Llama trained on one device (tests/sharded.py). The sizes,
options and the check of what ``configure_model`` split, in one process: tests/unit/test_tensor_parallel.py.
"""

import lightning as L
import pytest
import torch
from conftest import assert_states_close, assert_within_fp32_rounding, shared_run, state_distance
from sharded import hf_in_float64, hf_one_device
from tensor_parallel import CHECKPOINTED, HF_RUNS, MIXED, RUNS, TIED, SplitMLP, TiedSplitLM, in_float64, one_device

from lightning_gpipe.consolidate import consolidated_checkpoint

SPLIT = shared_run("tensor_parallel.py", devices=4, timeout=600)
"""Every run of :data:`tensor_parallel.RUNS`, :data:`tensor_parallel.MIXED` and :data:`tensor_parallel.CHECKPOINTED`
in the shared 4-process launch."""


@pytest.fixture(scope="module")
def out():
    return SPLIT()


@pytest.mark.parametrize("name", list(RUNS))
def test_tensor_parallel_stages_train_like_one_device(out, name):
    """Every parameter after 6 AdamW steps within fp32 rounding of one device's (the row-parallel layers sum their
    halves in another order), and the loss of every step."""
    overrides = RUNS[name][1]
    state, losses = one_device(**overrides)
    got = torch.load(out / f"{name}.pt")
    assert_within_fp32_rounding(got["state"], state, lambda: in_float64(overrides))
    torch.testing.assert_close(got["losses"], losses, atol=1e-5, rtol=0)
    assert len(got["losses"]) == len(losses)


@pytest.mark.parametrize("name", list(TIED))
def test_an_embedding_tied_to_the_head_across_stages_and_split_alike_trains_like_one_device(out, name):
    """The embedding (stage 0, split by rows) and the head (stage 1, split by output columns) share one weight, each
    stage's copy split alike over its 2 tensor ranks: under 1F1B with global clipping, every parameter after 6 AdamW
    steps within fp32 rounding of one device's and the loss of every step; the copies end equal."""
    overrides = TIED[name][1]
    state, losses = one_device(module_class=TiedSplitLM, **overrides)
    got = torch.load(out / f"{name}.pt")
    assert_within_fp32_rounding(got["state"], state, lambda: in_float64(overrides, module_class=TiedSplitLM))
    torch.testing.assert_close(got["losses"], losses, atol=1e-5, rtol=0)
    assert torch.equal(got["state"]["backbone.0.weight"], got["state"]["head.weight"])


@pytest.mark.parametrize("name", list(MIXED))
def test_bf16_mixed_tensor_parallel_stages_train_like_one_device_under_autocast(out, name):
    """``precision="bf16-mixed"`` on 2 stages x 2 tensor ranks against one device's ``bf16-mixed`` run, by the
    suite's bf16 rule (tests/distributed/test_transformers.py): the L2 distance over every parameter after 6 AdamW
    steps a small share of the update and smaller than the distance to one device's fp32 run (a run in fp32 would be
    about 0 from it), the losses within 1e-3.

    Not equal: a row-parallel layer's halves are each rounded to bf16 before their all-reduce, and a column-parallel
    layer's input-gradient halves likewise, where one device rounds the sum once, and AdamW turns small gradient
    differences into steps of about ``lr`` for entries whose gradient is near 0. Measured (torch 2.13, x86): distance
    0.41 to bf16 against 0.49 to fp32, for an update of 2.23 (18%; pp=2 alone, without the split: 0.14, 6%); losses
    within 2.5e-4."""
    overrides = MIXED[name][1]
    state, losses = one_device(**overrides)
    fp32, _ = one_device()
    L.seed_everything(1, verbose=False)  # as one_device: the initial weights
    initial = SplitMLP().state_dict()
    got = torch.load(out / f"{name}.pt")
    to_bf16 = state_distance(got["state"], state)
    assert to_bf16 <= 0.3 * state_distance(state, initial), to_bf16
    assert to_bf16 < state_distance(got["state"], fp32), to_bf16
    torch.testing.assert_close(got["losses"], losses, atol=1e-3, rtol=0)


@pytest.mark.parametrize("name", list(RUNS))
def test_each_tensor_rank_holds_about_half_of_its_stage(out, name):
    """The blocks' Linear weights are DTensors; each rank holds at most 0.55 of its stage's parameters (the row-parallel
    biases and the head are whole on every tensor rank), and the two tensor ranks of a stage hold the same count."""
    held = [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(4)]
    assert all(any(h["split"]) for h in held)
    assert all(h["local"] <= 0.55 * h["whole"] for h in held)
    assert held[0]["local"] == held[1]["local"]  # tensor ranks 0 and 1 of stage 0 (replica 0): ranks 0 and 1


@pytest.mark.parametrize("name", [name for name, (_, resumed) in CHECKPOINTED.items() if resumed])
def test_a_tensor_parallel_checkpoint_resumes_on_other_meshes(out, name):
    """The (2 stages x 2 tensor ranks) run's checkpoint after 4 steps (a full file, or a sharded directory) resumes on
    2 stages x 2 replicas (no tensor parallelism) and on 1 stage x 2 replicas x 2 tensor ranks (FSDP2): every parameter
    after 6 steps and the losses of the last 2 are the uninterrupted one-device run's."""
    state, losses = one_device()
    got = torch.load(out / f"{name}.pt")
    assert_within_fp32_rounding(got["state"], state, lambda: in_float64({}))
    torch.testing.assert_close(got["losses"], losses[-2:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("written", ["pp2_tp2_first4", "pp2_tp2_first4_sharded"])
def test_a_tensor_parallel_checkpoint_consolidates_into_the_plain_module(out, written):
    """The full file, and the sharded directory consolidated (``python -m lightning_gpipe.consolidate``'s
    dictionary), of the tensor-parallel run hold whole tensors under the module's own names and AdamW's whole state:
    the model loads strictly into the plain module, equal to one device's after 4 steps."""
    path = out / f"{written}.ckpt"
    checkpoint = consolidated_checkpoint(path) if path.is_dir() else torch.load(path, weights_only=False)
    module = SplitMLP()
    module.load_state_dict(checkpoint["state_dict"])
    state, _ = one_device(steps=4)
    assert_within_fp32_rounding(module.state_dict(), state, lambda: in_float64({}, steps=4))
    optimizer = checkpoint["optimizer_states"][0]
    for name, parameter in module.named_parameters():
        assert optimizer[f"state.{name}.exp_avg"].shape == parameter.shape, name


@pytest.mark.parametrize("name", list(HF_RUNS))
def test_a_hugging_face_llama_splits_by_its_declared_tensor_plan_and_trains_like_one_device(out, name):
    """``lightning_gpipe.hf.CausalLM`` (the tiny Llama, its embedding tied to its head across the stages, which stay
    whole) split by ``base_model_tp_plan`` on 2 stages x 2 tensor ranks, 4 AdamW steps: the attention and MLP
    projections were split (with LoRA: the adapters of the projections, laid out as their base layers); afterwards both
    tensor ranks of a stage hold the same whole tensors, the stages together every tensor of the unmodified model
    trained on one device (fp32 rounding bound), and the losses are its losses."""
    pytest.importorskip("transformers")
    lora = HF_RUNS[name]
    held = [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(4)]
    assert all(h["split"][0] > 0 for h in held), [h["split"] for h in held]
    for stage in (0, 2):  # global rank r is tensor rank r % 2 of stage r // 2
        assert_states_close(held[stage + 1]["state"], held[stage]["state"], atol=0.0)
    state, losses = hf_one_device(lora)
    merged = {**held[0]["state"], **held[2]["state"]}
    assert_within_fp32_rounding(merged, state, lambda: hf_in_float64(lora))
    torch.testing.assert_close(torch.tensor(held[2]["losses"]), torch.tensor(losses), atol=1e-5, rtol=0)
