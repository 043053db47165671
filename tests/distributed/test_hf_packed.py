"""Packed rows through the pipeline (issue 47): tests/workers/hf_packed.py in the shared launch of 2 processes, a tiny
Llama (``CausalLM``) fitted on batches of documents packed into rows (positions restarting per document, attention
kept inside each, 3 micro-batches of uneven real tokens) under ``gpipe``, ``1f1b`` and ``zb-1p``, and with LoRA
adapters: the first step's loss and every gradient, the later losses and the parameters after the AdamW steps equal
the same documents run one by one through the unmodified model on one device (1e-5). The batches carry
``num_targets`` and ``num_rows``, which make the per-micro-batch losses of 1F1B and ZB-1P add up to the mean over the
whole batch's targets."""

from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import documents_one_by_one, hf_one_device_optimizer, shared_run, worker_module

transformers = pytest.importorskip("transformers")


WORKER = worker_module("hf_packed.py")
RUNS = {
    schedule: shared_run(
        "hf_packed.py", "--devices=2", f"--schedule={schedule}", devices=2, timeout=180, name=f"hf-packed-{schedule}"
    )
    for schedule in ("gpipe", "1f1b", "zb-1p")
}
LORA = shared_run("hf_packed.py", "--devices=2", "--lora", devices=2, timeout=180, name="hf-packed-lora")


@cache
def _reference(lora: bool):
    """One device: the worker's starting model trained the same AdamW steps on the same documents, one by one:
    ``(the first step's gradients, per-step losses, the final state)``, by the model's names. Computed once for
    each ``lora`` (the three schedules' runs share the one without)."""
    model = WORKER.initial_lora() if lora else WORKER.initial_model(False)
    inner = model.get_base_model() if lora else model
    inner.config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
    model.train()
    losses, first = [], {}
    for step in range(WORKER.STEPS):
        losses.append(documents_one_by_one(model, WORKER.documents(step)).item())
        if step == 0:
            first = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
    return first, losses, inner.state_dict()


def _merged(out: Path, name: str) -> dict:
    merged: dict = {}
    for rank in range(2):
        merged.update(torch.load(out / f"{name}_rank{rank}.pt"))
    return merged


def _assert_equal_to_one_by_one(out: Path, lora: bool) -> None:
    first, losses, state = _reference(lora)
    grads = _merged(out, "grads")
    assert grads.keys() == first.keys() and first
    for name, grad in first.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)
    pipelined = _merged(out, "state")
    assert pipelined.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(pipelined[name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("schedule", list(RUNS))
def test_packed_rows_on_two_stages_equal_the_documents_run_one_by_one(schedule):
    """The first step's loss and gradients, the second step's loss and the parameters after 2 AdamW steps."""
    _assert_equal_to_one_by_one(RUNS[schedule](), lora=False)


def test_packed_rows_with_lora_adapters_equal_the_documents_run_one_by_one():
    pytest.importorskip("peft")
    _assert_equal_to_one_by_one(LORA(), lora=True)


def test_the_worker_batches_are_packed_and_their_micro_batches_uneven():
    """What the runs exercise: several documents in some rows, and 3 micro-batches of different real-token counts."""
    for batch in WORKER.batches():
        starts = ((batch["position_ids"] == 0) & (batch["attention_mask"] == 1)).sum(1)
        assert starts.max() > 1
        tokens = [part.sum().item() for part in torch.tensor_split(batch["attention_mask"], 3)]
        assert len(set(tokens)) > 1, tokens
