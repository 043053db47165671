"""V-Min, V-Half and V-ZB against 1F1B: measured activation bytes per stage, and the simulator's step against the
measured one.

The memory-controllable V schedules (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
:func:`lightning_gpipe.engine.schedule.v_min`) hold at most ``ceil(2K / 3)``, K and 2K micro-batches of a model chunk
(half a stage) per stage, against 1F1B's K micro-batches of a whole stage on its first. Each configuration is one
``Trainer.fit`` of the MLP (benchmarks/models.py, ``--depth`` (Linear, ReLU) pairs and a head) under
``GPipeStrategy(chunks=M, checkpoint="never", schedule=...)``, the V schedules with their two model chunks per stage
in a V, every (virtual) stage given the same number of layers (``balance=[...]``: the paper's equal model chunks).

- Memory, at ``--devices`` K: as ``benchmarks/memory.py`` measures it, in every stage process the peak bytes of the
  tensors autograd saves during training (``saved_tensors_hooks``, each storage once, parameters excluded, a
  micro-batch of the loader's mini-batch with its own bytes; the tracked allocations of the 1F1B memory bar), one fit
  of two steps each; the ratio of the largest stage's to 1F1B's, beside the simulator's prediction of that ratio
  (:func:`lightning_gpipe.simulate`, equal half-stage costs, activation bytes one row per layer and sample). Each
  model chunk also saves its input, so the measured ratio exceeds the plans' (3/8 and 1/2 at K=4) by about one
  layer's share: deep chunks (the default ``--depth``) make it small. A second table adds what the saved bytes
  leave out under the B/W split (the V schedules'; 1F1B runs whole backwards): the output gradients B keeps at each
  linear layer for its W (``_runs.py``'s ``peak_with_weights``), about as many bytes again per micro-batch between
  its B and its W on this MLP.
- Time, at ``--time-devices`` K (default 2: a core per stage on a 2-core machine), interleaved repeats: as
  ``benchmarks/breakdown.py`` measures it, each stage's spans per measured step; the simulator predicts the step from
  each stage's measured compute parts (:func:`breakdown.simulated_ms`), set beside the measured period of stage 0
  (medians over the repeats). More stages than free cores make the processes wait for a core, which no plan
  predicts.

Byte counts do not depend on the machine's load; step times do: run on a quiet machine.

Usage::

    python benchmarks/v_schedules.py          # memory at K=4, time at K=2; M=16, batch 512, width 512, depth 96
    python benchmarks/v_schedules.py --devices 2 --repeats 5
    python benchmarks/v_schedules.py --parts time --repeats 5
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
    parser.add_argument("--devices", type=int, default=4, help="K of the memory runs (default 4)")
    parser.add_argument("--time-devices", type=int, default=2, help="K of the timed runs (default 2)")
    parser.add_argument("--chunks", type=int, default=16, help="M, micro-batches (default 16)")
    parser.add_argument("--batch-size", type=int, default=512, help="N, rows per mini-batch (default 512)")
    parser.add_argument("--width", type=int, default=512, help="W, features per Linear layer (default 512)")
    parser.add_argument("--depth", type=int, default=96, help="L, (Linear, ReLU) pairs; 2K divides it (default 96)")
    parser.add_argument(
        "--parts", nargs="+", choices=("memory", "time"), default=["memory", "time"], help="what to measure (both)"
    )
    harness.add_timing_args(parser)
    args = parser.parse_args(argv)
    positive = ("devices", "time_devices", "chunks", "batch_size", "width", "depth", "repeats", "steps")
    harness.check_positive(parser, args, positive)
    if args.depth % (2 * args.devices) or args.depth % (2 * args.time_devices):
        parser.error("--depth must be a multiple of 2 * --devices and of 2 * --time-devices (equal model chunks)")
    return args


def _command(args: argparse.Namespace, schedule: str, devices: int) -> list[str]:
    """The arguments of ``benchmarks/_runs.py`` for one fit of ``schedule`` on ``devices`` stages, each (virtual)
    stage given an equal share of the backbone's ``2 * depth`` layers."""
    chunks = devices * (1 if schedule == "1f1b" else 2)
    balance = ",".join([str(2 * args.depth // chunks)] * chunks)
    command = ["lightning", *harness.mlp_run_args(args), "--chunks", str(args.chunks), "--checkpoint", "never"]
    return command + ["--schedule", schedule, "--devices", str(devices), "--balance", balance]


def measure_memory(args: argparse.Namespace, schedule: str) -> list[tuple[int, int]]:
    """One fit of two steps counting saved bytes; per stage, the peak bytes autograd held, and the peak with the
    gradients the B/W split keeps for W."""
    config = harness.Config(f"{schedule}/memory", [*_command(args, schedule, args.devices), "--count-saved"])
    config.args += ["--steps", "1", "--warmup", "1"]  # the later occurrences win
    return [(record["peak"], record["peak_with_weights"]) for record in harness.run_or_exit(config).records]


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


def measure_times(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Per schedule, the measured step (stage 0's period, median over the repeats, which interleave the schedules)
    and the simulator's prediction from the measured parts, in ms, at ``--time-devices`` stages."""
    parts: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.repeats):
        for schedule in SCHEDULES:
            command = [*_command(args, schedule, args.time_devices), "--strategy", "gpipe", "--breakdown"]
            for record in harness.run_or_exit(harness.Config(f"{schedule}/time", command)).records:
                for kind, ms in record["breakdown"].items():
                    parts.setdefault((schedule, record["stage"], kind), []).append(ms)
    found = {}
    for schedule in SCHEDULES:
        medians = {(k, kind): statistics.median(v) for (s, k, kind), v in parts.items() if s == schedule}
        shape = argparse.Namespace(
            devices=args.time_devices, chunks=args.chunks, checkpoint="never", schedule=schedule,
            virtual_stages=1 if schedule == "1f1b" else 2,
        )  # fmt: skip
        stages = sorted({stage for stage, _ in medians})
        found[schedule] = (medians[(0, "period")], simulated_ms(shape, medians, stages))
    return found


def main(argv: list[str] | None = None) -> None:
    """Measure each schedule's memory, then its step, and print them against 1F1B's and the simulator's."""
    args = parse_args(argv)
    harness.print_command(
        f"{args.depth} x (Linear({args.width}), ReLU) + head, batch N={args.batch_size}, fp32, M={args.chunks},"
        f" checkpoint='never', equal (virtual) stages; memory: K={args.devices}; time: K={args.time_devices},"
        f" {args.warmup} warm-up + {args.steps} measured steps, {args.repeats} interleaved repeats"
    )

    def body() -> None:
        if "memory" in args.parts:
            print_memory(args)
        if "time" in args.parts:
            print_times(args)

    harness.timed(body)


def print_memory(args: argparse.Namespace) -> None:
    """Measure and print each schedule's peak saved bytes per stage against 1F1B's and the simulator's ratio, then
    the same with the gradients the B/W split keeps for W."""
    peaks = {schedule: measure_memory(args, schedule) for schedule in SCHEDULES}
    for column, what in enumerate(("saved", "saved + kept for W")):
        base = max(peak[column] for peak in peaks["1f1b"])
        print(f"\n{'schedule':<9}{what + ', peak MiB per stage':>40}{'max / 1F1B':>12}{'predicted':>11}")
        for schedule, stages in peaks.items():
            peak = [stage[column] for stage in stages]
            cells = " ".join(f"{p / MIB:7.2f}" for p in peak)
            ratio = f"{max(peak) / base:>12.3f}{predicted_ratio(args, schedule):>11.3f}"
            print(f"{schedule:<9}{cells:>40}{ratio}", flush=True)


def print_times(args: argparse.Namespace) -> None:
    """Measure and print each schedule's step beside the simulator's prediction from its measured parts."""
    times = measure_times(args)
    print(f"\n{'schedule':<9}{'measured ms':>13}{'simulated ms':>14}{'simulated / measured':>22}")
    for schedule, (measured, simulated) in times.items():
        print(f"{schedule:<9}{measured:>13.1f}{simulated:>14.1f}{simulated / measured:>22.3f}", flush=True)


if __name__ == "__main__":
    main()
