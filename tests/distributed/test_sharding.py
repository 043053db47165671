"""Sharded data parallelism: a (2 stages x 2 replicas) mesh whose stages FSDP2 shards over their replicas trains
exactly like one device, under fill-drain, 1F1B, zero-bubble, interleaved and ZB-V plans, with clipping, accumulation
and tied parameters; each replica holds half of its stage's parameters and optimizer state; FSDP2 gathers at most once
per micro-batch forward and once per backward, and reduce-scatters once per optimizer step; its checkpoints resume on
other meshes, with and without sharding, and load into the plain module. A Hugging Face Llama trains sharded like
one device, its whole weights or its LoRA adapters.

Every run is tests/workers/sharding.py (one launch of 4 processes, shared with the suite's other 4-process runs); the
references are single-device Lightning on the same global batches (tests/sharded.py). The options' checks and the
FSDP2 wiring in one process: tests/unit/test_sharding.py.
"""

import pytest
import torch
from conftest import assert_states_close, assert_within_fp32_rounding, shared_run
from sharded import CHECKPOINTED, HF_RUNS, MIXED, RUNS, VALIDATED, AdamWNet, hf_in_float64, hf_one_device, one_device

from lightning_gpipe.consolidate import consolidated_checkpoint

SHARDED = shared_run("sharding.py", devices=4, timeout=1080)
"""Every run of :data:`sharded.RUNS`, :data:`sharded.CHECKPOINTED` and :data:`sharded.HF_RUNS` in the 4-process launch
the other tests share."""


@pytest.fixture(scope="module")
def out():
    return SHARDED()


@pytest.mark.parametrize("name", list(RUNS))
def test_a_sharded_mesh_trains_like_one_device(out, name):
    """Every parameter after 6 AdamW steps within 1e-5 of one device's (fp32), and the loss of every step; some runs
    validate after every epoch."""
    state, losses = one_device(name)
    got = torch.load(out / f"{name}.pt")
    assert_states_close(got["state"], state)
    torch.testing.assert_close(got["losses"], losses, atol=1e-5, rtol=0)
    assert len(got["losses"]) == len(losses)
    assert got["validated"] == (name in VALIDATED)  # sharded evaluation steps between the training steps


@pytest.mark.parametrize("name", list(RUNS))
def test_each_replica_holds_its_shard_of_parameters_and_optimizer_state(out, name):
    """Every parameter is a ``DTensor`` during training, and the two replicas of a stage hold disjoint halves (up to
    FSDP2's uneven last rows) of its parameters and of AdamW's two states."""
    held = [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(4)]
    for stage in range(2):
        replicas = [held[stage], held[stage + 2]]  # global rank r is stage r % 2 of replica r // 2
        whole = replicas[0]["whole"]
        assert all(all(h["dtensor"]) for h in replicas)
        assert sum(h["local"] for h in replicas) == whole
        assert all(h["local"] <= 0.55 * whole for h in replicas)
        assert sum(h["optimizer"] for h in replicas) == 2 * whole  # exp_avg and exp_avg_sq


def test_bf16_mixed_sharded_trains_like_bf16_mixed_ddp(out):
    """Under Lightning's autocast (``precision="bf16-mixed"``), FULL_SHARD's parameters and losses are DDP's."""
    ddp, sharded = (torch.load(out / f"{name}.pt") for name in MIXED)
    assert_states_close(sharded["state"], ddp["state"])
    torch.testing.assert_close(sharded["losses"], ddp["losses"], atol=1e-5, rtol=0)


UNITS = {0: 1, 1: 2}
"""FSDP units of each stage of ``AdamWNet`` on 2 stages: the stage's backbone layers, and on the last stage also the
head outside the backbone."""


def test_fill_drain_gathers_once_per_forward_and_once_per_backward_and_reduces_once_per_step(out):
    """FULL_SHARD, 8 micro-batches: each of stage 0's units gathers for each of the 8 forwards and once for the whole
    backward (9); the last stage's head, gathered for the step, once. One reduce-scatter per unit per step."""
    for rank in range(4):
        stage = rank % 2
        first = torch.load(out / f"full_gpipe_rank{rank}.pt")["collectives"][0]
        assert first == (9 + (UNITS[stage] - 1), UNITS[stage]), (rank, first)


def test_shard_grad_op_gathers_once_per_step_under_1f1b(out):
    for rank in range(4):
        stage = rank % 2
        counts = torch.load(out / f"grad_op_1f1b_rank{rank}.pt")["collectives"]
        assert all(step == (UNITS[stage], UNITS[stage]) for step in counts), (rank, counts)


def test_1f1b_full_shard_gathers_for_the_warmup_forwards_then_once_and_reduces_at_the_window_end(out):
    """Stage k of K=2 runs K - k forwards before its first backward, each gathering; then the parameters stay gathered.
    With accumulate_grad_batches=2 the first batch of each window reduces nothing, the second once per unit."""
    for rank in range(4):
        stage = rank % 2
        counts = torch.load(out / f"full_1f1b_clip_accumulate_rank{rank}.pt")["collectives"]
        gathers = (2 - stage) + 1 + (UNITS[stage] - 1)
        assert counts[:2] == [(gathers, 0), (gathers, UNITS[stage])], (rank, counts)


@pytest.mark.parametrize("name", list(CHECKPOINTED))
def test_a_checkpoint_of_a_sharded_run_resumes_on_other_meshes_with_or_without_sharding(out, name):
    """A (2, 2) run sharded by FULL_SHARD writes a sharded or a full checkpoint after 4 steps, which (4, 1) and (2, 2)
    under DDP or SHARD_GRAD_OP resume; a DDP run's sharded checkpoint resumes sharded. Each written state equals one
    device's after 4 steps, each resumed run the uninterrupted one's after 6, the losses of its last 2 steps too."""
    resumed = CHECKPOINTED[name][4] is not None
    state, losses = one_device(name, 6 if resumed else 4)
    got = torch.load(out / f"{name}.pt")
    assert_states_close(got["state"], state)
    torch.testing.assert_close(got["losses"], losses[-2:] if resumed else losses, atol=1e-5, rtol=0)


@pytest.mark.parametrize("written", ["sharded_ckpt_of_full_shard_first4", "full_ckpt_of_full_shard_first4"])
def test_the_checkpoints_of_a_sharded_run_load_into_the_plain_module(out, written):
    """The sharded directory, consolidated (``python -m lightning_gpipe.consolidate``'s dictionary), and the full file
    hold the whole model and its AdamW state, not one replica's shards."""
    path = out / f"{written}.ckpt"
    checkpoint = consolidated_checkpoint(path) if path.is_dir() else torch.load(path, weights_only=False)
    module = AdamWNet()
    module.load_state_dict(checkpoint["state_dict"])
    assert_states_close(module.state_dict(), one_device(written, 4)[0])
    optimizer = checkpoint["optimizer_states"][0]
    for name, parameter in module.named_parameters():
        assert optimizer[f"state.{name}.exp_avg"].shape == parameter.shape, name


@pytest.mark.parametrize("name", list(HF_RUNS))
def test_a_hugging_face_llama_trains_sharded_like_one_device_with_and_without_lora(out, name):
    """``lightning_gpipe.hf.CausalLM`` (the tiny Llama, its embedding tied to its head across the stages) under
    FULL_SHARD, 4 AdamW steps: every stage's parameters were ``DTensor`` shards; afterwards both replicas of a stage
    hold the same tensors, the stages together every tensor of the unmodified model trained on one device (fp32
    rounding bound: :func:`conftest.assert_within_fp32_rounding`), and the replicas' losses average to its losses.
    With LoRA only the adapters train: the base weights are the starting model's."""
    pytest.importorskip("transformers")
    lora = HF_RUNS[name]
    if lora:
        pytest.importorskip("peft")
    held = [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(4)]
    assert all(h["sharded"][0] == h["sharded"][1] > 0 for h in held), [h["sharded"] for h in held]
    for stage in range(2):  # global rank r is stage r % 2 of replica r // 2
        assert_states_close(held[stage + 2]["state"], held[stage]["state"], atol=0.0)
    state, losses = hf_one_device(lora)
    merged = {**held[0]["state"], **held[1]["state"]}
    assert_within_fp32_rounding(merged, state, lambda: hf_in_float64(lora))
    replicas = torch.tensor([held[1]["losses"], held[3]["losses"]]).mean(0)
    torch.testing.assert_close(replicas, torch.tensor(losses), atol=1e-5, rtol=0)
    if lora:
        initial = hf_one_device(lora, steps=0)[0]
        frozen = [key for key in state if ".lora_" not in key]
        assert frozen and all(torch.equal(merged[key], initial[key]) for key in frozen)
