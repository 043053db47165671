"""Train a CPU recipe in bf16 mixed precision only where this CPU runs it faster than fp32, as measured here.

A recipe tuned on a CPU that computes bf16 natively (an Intel Xeon with AMX, or AVX-512 BF16) asks for
``precision: bf16-mixed``; on a CPU without it (AVX2 only, e.g. an older AMD EPYC) torch emulates bf16 and the same
step runs several times slower than in fp32 (the AmoebaNet 20-minute recipe: 4.9 s per step in bf16-mixed against
1.6 s in 32-true on a 2-core AVX2 EPYC), so a time-budgeted recipe trains a third of the steps. With
``precision_fallback: true`` in its config the example's CLI times a small convolution block both ways before the
Trainer is built (two seconds on that EPYC) and trains in ``32-true`` where bf16 is not at least :data:`MIN_SPEEDUP`
times faster, saying so in one line.

Every stage process must train in the same precision: the process the user started measures, before the Trainer
starts the others, and leaves its choice in the environment (:data:`CHOICE`), which the stage processes Lightning
starts inherit and read instead of measuring.
"""

import os
import time

import torch
from torch import nn

CHOICE = "EXAMPLES_CPU_PRECISION"
"""The environment variable holding the choice of the process that measured (``"bf16-mixed"`` or ``"32-true"``)."""

MIN_SPEEDUP = 1.1
"""bf16 mixed precision is kept where it runs the block at least this many times faster than fp32."""

BF16_MIXED = ("bf16-mixed", "bf16")
"""The precisions the fallback applies to (Lightning's names for bf16 mixed precision)."""


def bf16_speedup(channels_last: bool = True, repeats: int = 3) -> float:
    """fp32 time over bf16-autocast time of a forward and backward of a 3x3 convolution block (Conv2d(64, 64),
    BatchNorm2d, ReLU) on a batch of 32 images of 32x32, the best of ``repeats`` runs each after one warm-up run.

    Args:
        channels_last: the block's weights and input in ``torch.channels_last`` memory format, as the recipe keeps
            them. Default ``True``.
        repeats: timed runs per precision. Default 3.

    Returns:
        The speed-up of bf16 mixed precision (above 1: bf16 is faster).
    """
    block = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
    images = torch.randn(32, 64, 32, 32)
    if channels_last:
        block, images = block.to(memory_format=torch.channels_last), images.to(memory_format=torch.channels_last)

    def best_seconds(bf16: bool) -> float:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                output = block(images)
            output.float().sum().backward()
            times.append(time.perf_counter() - start)
        return min(times[1:])

    return best_seconds(bf16=False) / best_seconds(bf16=True)


def cpu_precision(requested: str) -> tuple[str, str | None]:
    """The precision to train in on this CPU for a recipe that asks for ``requested``.

    Args:
        requested: the config's ``trainer.precision``.

    Returns:
        ``(precision, line)``: ``requested`` unless it is bf16 mixed precision that this CPU runs less than
        :data:`MIN_SPEEDUP` times faster than fp32 (then ``"32-true"``); ``line`` says what was measured and chosen
        (``None`` where nothing was measured: another precision, or a stage process reading :data:`CHOICE`).
    """
    if requested not in BF16_MIXED:
        return requested, None
    if CHOICE in os.environ:
        return os.environ[CHOICE], None
    speedup = bf16_speedup()
    precision = requested if speedup >= MIN_SPEEDUP else "32-true"
    os.environ[CHOICE] = precision
    verdict = "keeps" if precision == requested else "trains in 32-true instead of"
    line = (
        f"precision_fallback: bf16 mixed precision runs a convolution block {speedup:.2f}x as fast as fp32 on this"
        f" CPU ({MIN_SPEEDUP}x needed), so the run {verdict} {requested}; --precision_fallback=false keeps"
        " the config's precision."
    )
    return precision, line
