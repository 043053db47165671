"""V-Min, V-Half and V-ZB against 1F1B: measured activation bytes per stage, and the simulator's step against the
measured one.

The memory-controllable V schedules (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
:func:`lightning_gpipe.engine.schedule.v_min`) hold at most ``ceil(2K / 3)``, K and 2K micro-batches of a model chunk
(half a stage) per stage, against 1F1B's K micro-batches of a whole stage on its first. Each configuration is one
``Trainer.fit`` of the balanced MLP (benchmarks/models.py, ``--depth`` (Linear, ReLU) pairs and a head) under
``GPipeStrategy(chunks=M, checkpoint="never", schedule=...)`` with ``devices=K``, the V schedules with their two
model chunks per stage in a V.

- Memory: as ``benchmarks/memory.py`` measures it, in every stage process the peak bytes of the tensors autograd
  saves (``saved_tensors_hooks``, each storage once, parameters excluded; the tracked allocations of the 1F1B memory
  bar), one fit of two steps each; the ratio of the largest stage's to 1F1B's, beside the simulator's prediction of
  that ratio (:func:`lightning_gpipe.simulate`, equal half-stage costs, activation bytes one row per layer and
  sample).
- Time: as ``benchmarks/breakdown.py`` measures it, each stage's spans per measured step; the simulator predicts the
  step from each stage's measured compute parts (:func:`breakdown.simulated_ms`) and is set beside the measured
  period of stage 0 (medians over the repeats).

Byte counts do not depend on the machine's load; step times do: run on a machine with a free core per stage.

Usage::

    python benchmarks/v_schedules.py                        # K=4, M=16, batch 1024, width 1024, depth 8
    python benchmarks/v_schedules.py --devices 2 --repeats 3
"""

import argparse
import statistics

import _harness as harness
from breakdown import simulated_ms

from lightning_gpipe.planning.simulator import StageCost, simulate

MIB = 2**20
SCHEDULES = ("1f1b", "v-min", "v-half", "v-zb")
"""1F1B, the baseline, then the V schedules."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="K, stages (default 4)")
    parser.add_argument("--chunks", type=int, default=16, help="M, micro-batches (default 16)")
    parser.add_argument("--batch-size", type=int, default=1024, help="N, rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="W, features per Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="L, (Linear, ReLU) pairs; 2K divides it (default 8)")
    harness.add_timing_args(parser)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth", "repeats", "steps"))
    if args.depth % (2 * args.devices):
        parser.error("--depth must be a multiple of 2 * --devices (equal model chunks)")
    return args


def _command(args: argparse.Namespace, schedule: str) -> list[str]:
    """The arguments of ``benchmarks/_runs.py`` for one fit of ``schedule``."""
    command = ["lightning", *harness.mlp_run_args(args), "--chunks", str(args.chunks), "--checkpoint", "never"]
    return command + ["--schedule", schedule]


def measure_memory(args: argparse.Namespace, schedule: str) -> list[int]:
    """One fit of two steps counting saved bytes; per stage, the peak bytes autograd held."""
    config = harness.Config(f"{schedule}/memory", [*_command(args, schedule), "--count-saved"])
    config.args += ["--steps", "1", "--warmup", "1"]  # the later occurrences win
    return [record["peak"] for record in harness.run_or_exit(config).records]


def predicted_ratio(args: argparse.Namespace, schedule: str) -> float:
    """The simulator's peak activation bytes of ``schedule`` over 1F1B's, with equal stages of one saved row per
    layer and sample (the V's model chunks half a stage each)."""
    rows, layers = args.batch_size / args.chunks, args.depth / args.devices
    whole = StageCost(1.0, 2.0, activation_bytes=round(4 * args.width * rows * layers))
    half = StageCost(0.5, 1.0, weight=0.5, activation_bytes=whole.activation_bytes // 2)
    base = max(simulate([whole] * args.devices, args.chunks, "never", schedule="1f1b").peak_activation_bytes)
    if schedule == "1f1b":
        return 1.0
    v = simulate([half] * (2 * args.devices), args.chunks, "never", schedule=schedule, virtual_stages=2)
    return max(v.peak_activation_bytes) / base


def measure_time(args: argparse.Namespace, schedule: str) -> tuple[float, float]:
    """The measured step (stage 0's period, median over the repeats) and the simulator's prediction from the
    measured parts, in ms."""
    parts: dict[tuple[int, str], list[float]] = {}
    command = [*_command(args, schedule), "--strategy", "gpipe", "--breakdown"]
    for _ in range(args.repeats):
        for record in harness.run_or_exit(harness.Config(f"{schedule}/time", command)).records:
            for kind, ms in record["breakdown"].items():
                parts.setdefault((record["stage"], kind), []).append(ms)
    medians = {key: statistics.median(values) for key, values in parts.items()}
    virtual = 1 if schedule == "1f1b" else 2
    shape = argparse.Namespace(
        devices=args.devices, chunks=args.chunks, checkpoint="never", schedule=schedule, virtual_stages=virtual
    )
    stages = sorted({stage for stage, _ in medians})
    return medians[(0, "period")], simulated_ms(shape, medians, stages)


def main(argv: list[str] | None = None) -> None:
    """Measure each schedule's memory, then its step, and print them against 1F1B's and the simulator's."""
    args = parse_args(argv)
    harness.print_command(
        f"{args.depth} x (Linear({args.width}), ReLU) + head, batch N={args.batch_size}, fp32, K={args.devices},"
        f" M={args.chunks}, checkpoint='never'; time: {args.warmup} warm-up + {args.steps} measured steps,"
        f" {args.repeats} repeats"
    )

    def body() -> None:
        peaks = {schedule: measure_memory(args, schedule) for schedule in SCHEDULES}
        base = max(peaks["1f1b"])
        print(f"\n{'schedule':<9}{'peak MiB per stage':>40}{'max / 1F1B':>12}{'predicted':>11}")
        for schedule, peak in peaks.items():
            cells = " ".join(f"{p / MIB:7.1f}" for p in peak)
            print(
                f"{schedule:<9}{cells:>40}{max(peak) / base:>12.3f}{predicted_ratio(args, schedule):>11.3f}",
                flush=True,
            )
        print(f"\n{'schedule':<9}{'measured ms':>13}{'simulated ms':>14}{'simulated / measured':>22}")
        for schedule in SCHEDULES:
            measured, simulated = measure_time(args, schedule)
            print(f"{schedule:<9}{measured:>13.1f}{simulated:>14.1f}{simulated / measured:>22.3f}", flush=True)

    harness.timed(body)


if __name__ == "__main__":
    main()
