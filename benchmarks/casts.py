"""Autocast's casts of the weights once per step against once per micro-batch, in a one-stage pipeline.

Under mixed precision the strategy's step keeps autocast's cache on (``lightning_gpipe.lightning.step``), so each
weight is cast once per autocast region of a step instead of once per micro-batch, as Lightning's own step context
(cache off) would. This times one ``GPipeStrategy(chunks=M)`` process with the cache (``cached``) and without it
(``per use``: the check :func:`~lightning_gpipe.lightning.step.cache_keeps_gradients` answered False), in
interleaved repeats, on CUDA if there is a GPU (the device synchronised at each step's end), else on the CPU on one
thread. Prints each run's median seconds per step and the ratio per use / cached (> 1: the cache is faster).

Usage::

    python benchmarks/casts.py                                  # 8 x Linear(1024), batch 256, M = 4, bf16-mixed
    python benchmarks/casts.py --width 4096 --rows 8192 --precision 16-mixed

Results in docs/benchmarks.md ("Host synchronisations and casts").
"""

import argparse
import statistics
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import StepClock  # noqa: E402
from benchmarks.models import MLPClassifier, mlp_batch, repeat_loader  # noqa: E402
from lightning_gpipe import GPipeStrategy  # noqa: E402
from lightning_gpipe.lightning import step  # noqa: E402

_PROBE = step.cache_keeps_gradients


class _Clock(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.clock = StepClock(warmup)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.clock.mark()


def step_seconds(args: argparse.Namespace, cached: bool) -> float:
    """Median seconds per step of one fit, with the weights' casts cached or cast per use."""
    if not cached:
        step.cache_keeps_gradients = lambda: False
    try:
        clock = _Clock(args.warmup)
        batch = mlp_batch(args.rows, args.width)
        trainer = pl.Trainer(strategy=GPipeStrategy(chunks=args.chunks, checkpoint="never"), devices=1,
                             accelerator="gpu" if torch.cuda.is_available() else "cpu", precision=args.precision,
                             max_steps=args.warmup + args.steps, callbacks=[clock], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)  # fmt: skip
        trainer.fit(MLPClassifier(args.width, args.depth), repeat_loader(batch, args.warmup + args.steps))
        return clock.clock.summary()["median_s"]
    finally:
        step.cache_keeps_gradients = _PROBE


def main() -> None:
    """Time both, interleaved, and print the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--rows", type=int, default=256, help="rows per mini-batch")
    parser.add_argument("--chunks", type=int, default=4, help="M, micro-batches")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not _PROBE():
        sys.exit("this torch's autocast cache loses gradients after a no_grad cast: the strategy does not use it")
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for cached in (True, False):
            times[cached].append(step_seconds(args, cached))
            label = "cached " if cached else "per use"
            print(f"repeat {repeat + 1}  {label}  {times[cached][-1]:.4f} s/step", flush=True)
    ratios = [per_use / cached for cached, per_use in zip(times[True], times[False])]
    cached, per_use = statistics.median(times[True]), statistics.median(times[False])
    print(f"per use / cached = {per_use:.4f} / {cached:.4f} = {per_use / cached:.2f}x  (per repeat: "
          + ", ".join(f"{ratio:.2f}" for ratio in ratios) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
