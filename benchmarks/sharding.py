"""Each process's state with its stage sharded over the replicas (FSDP2) against whole copies (DDP), on pp=2 x dp=2.

One launch of 4 CPU processes (Lightning's launcher, gloo) fits the balanced MLP (benchmarks/models.py, ``width`` x
``depth`` pairs of ``Linear``, ReLU; 50.4M parameters by default) with AdamW under ``GPipeStrategy(
pipeline_parallel_size=2, data_parallel_size=2, chunks=M, sharding_strategy=S)`` for S in ``NO_SHARD`` (DDP),
``SHARD_GRAD_OP`` and ``FULL_SHARD``, one after the other in the same processes. Every process measures, at the last
step's ``on_before_optimizer_step`` (parameters, gradients and AdamW's two states all exist then):

- ``state``: the bytes of the parameters, gradients and optimizer state it holds (a ``DTensor``'s local shard);
  DDP's gradient buckets, a second copy of the gradients, are not counted;
- ``peak``: its resident set's peak during the fit over its size before the model was built (``VmHWM`` after
  resetting it through ``/proc/self/clear_refs``; every allocation of 64 KiB or more its own mapping, unmapped when
  freed, so the resident set follows the live tensors): parameters, gradients, buckets, optimizer state, the
  parameters FSDP2 gathers for a step, activations;
- FSDP2's collectives in the last step: the calls of ``dist.all_gather_single`` and ``dist.reduce_scatter_single``
  (DDP's all-reduces run in its C++ reducer, one per bucket, and are not counted).

Sharded state over DDP's should be about 1/D (0.5): parameters, gradients and AdamW state are all sharded. The
collectives per step: each FSDP unit (a model chunk's layers; on the last stage also the head) reduce-scatters once,
and gathers M + 1 times under ``FULL_SHARD`` (each micro-batch forward of the fill, then once for the drain), once
under ``SHARD_GRAD_OP``; the head, gathered for the step, once.

Byte counts do not depend on the machine's load: each configuration runs once, after a warm-up fit of a tiny MLP under
each mode (the one-time costs of the processes' first fits).

Usage::

    python benchmarks/sharding.py                      # 50.4M parameters, M=8
    python benchmarks/sharding.py --width 1024 --depth 8 --chunks 4 --steps 2
"""

import argparse
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _held import Measure, count_calls  # noqa: E402
from models import MLPClassifier, mlp_batch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_gpipe import GPipeStrategy  # noqa: E402

MODES = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
MIB = 2**20
COLLECTIVES = ("all_gather_single", "reduce_scatter_single")
"""FSDP2's collectives, counted (:func:`_held.count_calls`)."""


class AdamWMLP(MLPClassifier):
    """The balanced MLP trained with AdamW (two states per parameter)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def fit(args: argparse.Namespace, mode: str) -> dict | None:
    """One fit under ``mode``; every process's record on global rank 0 (``None`` elsewhere)."""
    strategy = GPipeStrategy(
        pipeline_parallel_size=2,
        data_parallel_size=2,
        chunks=args.chunks,
        sharding_strategy=mode,
        defer_weight_grad=False,
    )
    measure = Measure()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=4, max_steps=args.steps, callbacks=[measure], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    x, y = mlp_batch(2 * args.batch_size * args.steps, args.width)
    pl.seed_everything(0, verbose=False)
    trainer.fit(AdamWMLP(args.width, args.depth), DataLoader(TensorDataset(x, y), batch_size=args.batch_size))
    record = {"rank": trainer.global_rank, "state": measure.state, "peak": measure.peak}
    record["collectives"] = [measure.collectives[name] for name in COLLECTIVES]
    records: list = [None] * 4
    dist.all_gather_object(records, record)
    return records if trainer.global_rank == 0 else None


def report(args: argparse.Namespace, results: dict[str, list[dict]]) -> None:
    """Print each process's figures per mode, then sharded over DDP."""
    parameters = args.depth * (args.width * args.width + args.width) + args.width * 10 + 10
    print(f"balanced MLP, width {args.width}, depth {args.depth}: {parameters / 1e6:.1f}M parameters, AdamW;")
    print(f"pp=2 x dp=2 (4 CPU processes, gloo), M={args.chunks}, {args.batch_size} rows per replica per step\n")
    header = f"{'mode':<14} {'rank':>4} {'stage':>5} {'state MiB':>10} {'peak MiB':>9}"
    print(f"{header} {'all-gathers':>12} {'reduce-scatters':>16}")
    for mode, records in results.items():
        for r in records:
            gathers, scatters = r["collectives"] if mode != "NO_SHARD" else ("-", "-")
            line = f"{mode:<14} {r['rank']:>4} {r['rank'] % 2:>5} {r['state'] / MIB:>10.1f} {r['peak']:>9.1f}"
            print(f"{line} {gathers:>12} {scatters:>16}")
    print()
    for mode in MODES[1:]:
        for r, ddp in zip(results[mode], results["NO_SHARD"]):
            state, peak = r["state"] / ddp["state"], r["peak"] / ddp["peak"]
            print(
                f"{mode} / NO_SHARD, rank {r['rank']}: state {state:.3f}x (<= 0.55: {state <= 0.55}), peak {peak:.2f}x"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="features per Linear layer (default 2048)")
    parser.add_argument("--depth", type=int, default=12, help="(Linear, ReLU) pairs (default 12: 50.4M parameters)")
    parser.add_argument("--chunks", type=int, default=8, help="M, micro-batches per step (default 8)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per replica per step (default 64)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per fit; the last is measured (default 3)")
    args = parser.parse_args()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: every large allocation its own mapping, unmapped when freed
    for name in COLLECTIVES:
        count_calls(dist, name)
    warmup = argparse.Namespace(**{**vars(args), "width": 64, "depth": 2, "steps": 1})
    for mode in MODES:  # the one-time costs (imports, gloo's buffers, FSDP2's first use) before any measured fit
        fit(warmup, mode)
    results = {mode: fit(args, mode) for mode in MODES}
    if all(records is not None for records in results.values()):
        report(args, results)  # type: ignore[arg-type]
        print("\n" + json.dumps({mode: records for mode, records in results.items()}))


if __name__ == "__main__":
    main()
