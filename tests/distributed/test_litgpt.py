"""litgpt's ``GPT`` in the pipeline (lightning_gpipe.litgpt), distributed: tests/workers/litgpt_models.py in the shared
launches of 2 and 4 processes. A tiny Pythia (parallel residual, partial rotary) and a tiny Llama (RMSNorm, SwiGLU,
grouped queries), each stage reading its own tensors of a ``lit_model.pth``, train 3 steps on 2 stages like the
unmodified ``GPT`` on one device (SGD to 1e-5 under fill-drain, AdamW within fp32 rounding under fill-drain and
1F1B), the Llama also on 2 stages x 2 FSDP2 replicas; pipelined greedy decoding equals litgpt's own ``generate``.
The single-process checks (the cut, one-stage decoding, checkpoint reads): tests/unit/test_litgpt.py.
"""

import pytest
import torch
from conftest import assert_states_close, assert_within_fp32_rounding, shared_run, worker_module

pytest.importorskip("litgpt")

WORKER = worker_module("litgpt_models.py")
TWO_STAGES = shared_run("litgpt_models.py", "--devices=2", devices=2, timeout=400, name="litgpt-2")
SHARDED = shared_run("litgpt_models.py", "--devices=4", devices=4, timeout=300, name="litgpt-pp2-dp2")


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def trained_on_one_device(config: str, optimizer: str, batches: list, dtype: torch.dtype = torch.float32) -> dict:
    """The state of the unmodified ``GPT`` of ``config`` trained on one device, a step per batch."""
    model = WORKER.initial_model(config, dtype)
    settings = WORKER.OPTIMIZERS[optimizer]
    step = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    opt = step(model.parameters(), **settings)
    for ids in batches:
        next_token_loss(model(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _merged(out, name: str, ranks: int = 2) -> dict:
    merged: dict = {}
    for rank in range(ranks):
        merged.update(torch.load(out / f"state_{name}_rank{rank}.pt"))
    return merged


@pytest.mark.parametrize("name", list(WORKER.CASES))
def test_two_stages_train_like_the_gpt_on_one_device(name):
    config, _, optimizer = WORKER.CASES[name]
    state = _merged(TWO_STAGES(), name)
    expected = trained_on_one_device(config, optimizer, WORKER.batches())
    if optimizer == "sgd":
        assert_states_close(state, expected)
        return
    exact = lambda: trained_on_one_device(config, optimizer, WORKER.batches(), torch.float64)  # noqa: E731
    assert_within_fp32_rounding(state, expected, exact)


def test_two_stages_times_two_sharded_replicas_train_like_one_device():
    """pp 2 x dp 2 with FULL_SHARD: replica r reads rows r, r + 2, ... of Lightning's distributed sampler (shuffled
    with seed 0); one device reads the same rows in batches of 8, in the order the sampler gives both replicas."""
    from torch.utils.data.distributed import DistributedSampler

    out = SHARDED()
    rows = [row for batch in WORKER.batches() for row in batch]
    order = list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=0))
    batches = [torch.stack([rows[j] for j in order[i : i + WORKER.ROWS]]) for i in range(0, len(rows), WORKER.ROWS)]
    config, _, optimizer = WORKER.SHARDED
    expected = trained_on_one_device(config, optimizer, batches)
    states = [torch.load(out / f"state_sharded_rank{rank}.pt") for rank in range(4)]
    exact = lambda: trained_on_one_device(config, optimizer, batches, torch.float64)  # noqa: E731
    for state in states:  # both replicas of each stage hold the one-device parameters, whole
        assert_within_fp32_rounding(state, {k: expected[k] for k in state}, exact)
    assert set().union(*states) == set(expected)


@pytest.mark.parametrize("config", list(WORKER.CONFIGS))
def test_pipelined_greedy_generation_equals_litgpt_generate(config):
    from litgpt.generate.base import generate

    generated = torch.load(TWO_STAGES() / f"generated_{config}.pt")
    model = WORKER.initial_model(config).eval()
    expected = []
    for prompt in WORKER.prompts():
        length = len(prompt) + WORKER.MAX_NEW_TOKENS
        model.max_seq_length = length
        model.set_kv_cache(batch_size=1)
        expected.append(generate(model, prompt, length, temperature=0.0))
        model.clear_kv_cache()
    assert torch.equal(generated, torch.stack(expected))
