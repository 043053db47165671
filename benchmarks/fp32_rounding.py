"""How far two fp32 trainings of one model on one device drift apart when only the order of the sums differs: the
whole batch against the pipeline's micro-batches, and each against float64 (docs/benchmarks.md, "Equal to one
device: what fp32 rounding leaves").

Each tiny Hugging Face model of ``tests/hf_families.py`` is trained ``STEPS`` steps, from the same seed, on the same
batches (``tests/workers/transformers_hf.py``'s ``initial_model`` and ``batches``), in one process, three ways:

- ``whole``: the model's own forward on each whole batch of 6 rows, in fp32;
- ``micro-batched``: the same rows as ``--chunks`` micro-batches (as ``torch.tensor_split``, as the pipeline splits
  them), their logits joined before the loss, as fill-drain computes the loss, in fp32;
- ``float64``: the whole batch in float64, the reference for both.

The optimizer is AdamW with ``CausalLM``'s parameter groups and schedule (``tests/conftest.py``'s
``hf_one_device_optimizer`` with the worker's ``OPTIMIZATION``), or SGD (lr 1e-2, momentum 0.9). Printed per model
and optimizer: the largest absolute difference of any weight after the last step, and the weight where it is. No
clock is read: one run gives the figures (they depend on the CPU's fp32 kernels, not on its load).

Usage::

    python benchmarks/fp32_rounding.py                          # llama, qwen3, gpt2, olmo2, gpt_neox, phi
    python benchmarks/fp32_rounding.py --families phi --chunks 3
"""

import argparse
import sys
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPOSITORY / "tests"), str(REPOSITORY / "tests" / "workers")]  # the tests' models and batches

import transformers_hf as worker  # noqa: E402 - tests/workers, on the path above
from conftest import hf_one_device_optimizer  # noqa: E402 - tests/, on the path above


def logits(model: torch.nn.Module, batch: dict, chunks: int) -> torch.Tensor:
    """``model``'s logits of ``batch``, its rows run as ``chunks`` micro-batches and joined (1: the whole batch)."""
    ids, mask = batch["input_ids"].tensor_split(chunks), batch["attention_mask"].tensor_split(chunks)
    return torch.cat([model(input_ids=i, attention_mask=m).logits for i, m in zip(ids, mask)])


def train(family: str, chunks: int, dtype: torch.dtype, optimizer_name: str) -> dict[str, torch.Tensor]:
    """The weights (as float64) after training ``family``'s tiny model on the worker's batches."""
    model = worker.initial_model(family).to(dtype)
    model.config._attn_implementation = "eager"  # one attention kernel for every dtype
    model.train()
    if optimizer_name == "adamw":
        optimizer, schedule = hf_one_device_optimizer(model, worker.OPTIMIZATION, worker.STEPS)
    else:
        optimizer, schedule = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), None
    for batch in worker.batches(family):
        loss = model.loss_function(logits(model, batch, chunks), batch["labels"], vocab_size=model.config.vocab_size)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule is not None:
            schedule.step()
    return {name: value.detach().double() for name, value in model.state_dict().items()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str:
    """The largest absolute difference of any weight between ``a`` and ``b``, and that weight's name."""
    name = max(a, key=lambda key: (a[key] - b[key]).abs().max().item())
    return f"{(a[name] - b[name]).abs().max().item():.1e} ({name})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3", "gpt2", "olmo2", "gpt_neox", "phi"])
    parser.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"], choices=["sgd", "adamw"])
    parser.add_argument("--chunks", type=int, default=3, help="micro-batches of the micro-batched run (default 3)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {worker.STEPS} steps, {args.chunks} micro-batches")
    for family in args.families:
        for optimizer_name in args.optimizers:
            whole = train(family, 1, torch.float32, optimizer_name)
            micro = train(family, args.chunks, torch.float32, optimizer_name)
            exact = train(family, 1, torch.float64, optimizer_name)
            print(
                f"{family:9} {optimizer_name:5}  micro-batched vs whole {largest_difference(micro, whole)};"
                f"  whole vs float64 {largest_difference(whole, exact)};"
                f"  micro-batched vs float64 {largest_difference(micro, exact)}"
            )


if __name__ == "__main__":
    main()
