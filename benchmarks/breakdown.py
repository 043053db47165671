"""Where each stage's training step goes, under GPipeStrategy through Lightning, next to plain Lightning.

One configuration of the balanced MLP (benchmarks/models.py) runs as plain Lightning (1 process x 1 thread)
and as ``GPipeStrategy`` (K processes x 1 thread), interleaved fresh processes. In every stage process a
callback reads the stage's own spans (``lightning_gpipe.engine.events``) for each measured step and splits the
step's period (one ``on_train_batch_start`` to the next) into: forward, recompute, backward, weight (the
deferred weight gradients, with ``--defer-weight-grad``), loss (the last
stage's head and loss, and their backward to the boundary), recv (waiting for a neighbour), send (posting
sends, and the final flush), relay (sharing the logged results), optimizer (the step and Lightning's hooks
after it), lightning in step (the rest of the batch: the user's step before the backbone call, zero_grad,
Lightning's hooks) and between steps (data loading, the loop's bookkeeping). The parts add up to the period.
Last, ``lightning_gpipe.simulate`` predicts the step from the measured compute parts (forward, recompute,
backward, weight and loss per micro-batch; relay, optimizer and Lightning's parts per step) and is set beside the
measured period; what it leaves out is the time in transfers (recv and send beyond the waits its plans imply).

Usage::

    python benchmarks/breakdown.py                               # K=2, M=8, batch 1024, checkpoint="never"
    python benchmarks/breakdown.py --checkpoint except_last --repeats 5
    python benchmarks/breakdown.py --schedule zb-h1                # zero-bubble ZB-H1 (its B/W split is its default)
    python benchmarks/breakdown.py --schedule 1f1b --virtual-stages 2  # interleaved 1F1B
"""

import argparse
import statistics

import _harness as harness

from lightning_gpipe.engine.actions import stage_of_virtual
from lightning_gpipe.engine.rematerialization import recomputed_share
from lightning_gpipe.engine.schedule import SCHEDULES, V_SHAPED
from lightning_gpipe.planning.simulator import StageCost, simulate

ORDER = (
    "forward",
    "recompute",
    "backward",
    "weight",
    "loss",
    "recv",
    "send",
    "relay",
    "optimizer",
    "lightning in step",
    "between steps",
)
"""The parts of a step, in the order they are printed."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="K, stages (default 2)")
    parser.add_argument("--chunks", type=int, default=8, help="M (default 8)")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="features per Linear layer (default 1024)")
    parser.add_argument(
        "--defer-weight-grad", action="store_true", help="GPipeStrategy(defer_weight_grad=True): the B/W split"
    )
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe", help="default gpipe")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        help="GPipeStrategy(virtual_stages=...), model chunks per stage (default: 1; 2 for zb-v)",
    )
    harness.add_timing_args(parser)
    args = parser.parse_args(argv)
    if args.virtual_stages is None:
        args.virtual_stages = 2 if args.schedule in V_SHAPED else 1
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "repeats", "virtual_stages"))
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """Plain Lightning, the strategy on one device (its defaults: one micro-batch) and the pipeline, with the same
    model, batch and steps."""
    common = ["lightning", "--batch-size", str(args.batch_size), "--width", str(args.width)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    pipeline = ["--strategy", "gpipe", "--devices", str(args.devices), "--chunks", str(args.chunks)]
    pipeline += ["--checkpoint", args.checkpoint, "--schedule", args.schedule, "--breakdown"]
    pipeline += ["--virtual-stages", str(args.virtual_stages)]
    pipeline += ["--defer-weight-grad"] if args.defer_weight_grad else []
    one = ["--strategy", "gpipe", "--devices", "1", "--chunks", "1", "--checkpoint", "except_last"]
    return [
        harness.Config("plain", [*common, "--strategy", "plain"], describe="plain Lightning, 1 process x 1 thread"),
        harness.Config("one", [*common, *one], describe="GPipeStrategy() on devices=1: its default, one micro-batch"),
        harness.Config(
            "gpipe",
            [*common, *pipeline],
            describe=f"GPipeStrategy(chunks={args.chunks}, checkpoint={args.checkpoint!r},"
            f" schedule={args.schedule!r}, defer_weight_grad={args.defer_weight_grad or None},"
            f" virtual_stages={args.virtual_stages}), devices={args.devices}",
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the breakdown per stage."""
    args = parse_args(argv)
    grid = configs(args)
    harness.print_header(
        f"8 x (Linear({args.width}), ReLU) + head, batch {args.batch_size}, SGD; {args.warmup} warm-up +"
        f" {args.steps} measured steps per run; {args.repeats} interleaved repeats",
        grid,
        "per stage, mean ms per measured step of each part; medians over the repeats",
    )

    def body() -> None:
        plain, one, parts = [], [], {}
        for repeat in range(args.repeats):
            ticks = harness.cpu_ticks()
            for config in grid:
                outcome = harness.run_or_exit(config)
                if config.name in ("plain", "one"):
                    (plain if config.name == "plain" else one).append(1e3 * outcome.records[0]["median_s"])
                    continue
                for record in outcome.records:
                    for kind, ms in record["breakdown"].items():
                        parts.setdefault((record["stage"], kind), []).append(ms)
                print(
                    f"repeat {repeat + 1}: plain {plain[-1]:.1f}, one device {one[-1]:.1f} ms/step; gpipe periods "
                    + ", ".join(f"stage {r['stage']} {r['breakdown']['period']:.1f} ms" for r in outcome.records)
                    + f"; stolen {100 * harness.stolen_share(ticks, harness.cpu_ticks()):.0f}% of the CPU time",
                    flush=True,
                )
        stages = sorted({stage for stage, _ in parts})
        print()
        print(f"{'part (ms/step)':<20}" + "".join(f"{'stage ' + str(k):>12}" for k in stages))
        for kind in (*ORDER, "period"):
            cells = [statistics.median(parts.get((k, kind), [0.0])) for k in stages]
            print(f"{kind:<20}" + "".join(f"{c:>12.1f}" for c in cells))
        step, base = statistics.median(parts[(0, "period")]), statistics.median(plain)
        ideal = args.devices * args.chunks / (args.chunks + args.devices - 1)
        print(
            f"\nplain Lightning: {base:.1f} ms/step; speed-up {base / step:.2f}x (fill-drain ideal {ideal:.2f}x,"
            f" {base / step / ideal:.0%} of it)"
        )
        alone = statistics.median(one)
        print(
            f"GPipeStrategy on one device: {alone:.1f} ms/step, {alone / base - 1:+.1%} over plain Lightning"
            f" (per repeat: {', '.join(f'{o / p - 1:+.1%}' for o, p in zip(one, plain))})"
        )
        predicted = simulated_ms(args, {key: statistics.median(values) for key, values in parts.items()}, stages)
        print(f"simulated step: {predicted:.1f} ms, {predicted / step:.2f} of the measured period")

    harness.timed(body)


def simulated_ms(args: argparse.Namespace, parts: dict[tuple[int, str], float], stages: list[int]) -> float:
    """The step :func:`~lightning_gpipe.planning.simulator.simulate` predicts, in ms, from each stage's measured compute
    parts (``parts[(stage, part)]``, ms per step); the parts each stage runs once per step (the relay, the
    optimizer, Lightning's in the step and between steps) are put with the optimizer step, at the step's end. With
    virtual stages, each of a stage's chunks takes an equal share of its parts (the balanced MLP's are equal); in
    ZB-V's V, the stage of each virtual stage is the V's."""
    v, v_shape = args.virtual_stages, args.schedule in V_SHAPED
    owners = [stages[stage_of_virtual(s, len(stages), v_shape)[0]] for s in range(len(stages) * v)]
    recomputed = round(recomputed_share(args.checkpoint, args.chunks) * args.chunks) * v  # chunk recomputes

    def part(k: int, kind: str) -> float:
        return parts.get((k, kind), 0.0) / 1e3

    runs = args.chunks * v  # each micro-batch runs once on each chunk
    costs = [
        StageCost(
            part(k, "forward") / runs,
            (part(k, "backward") + part(k, "weight")) / runs,
            part(k, "recompute") / recomputed if recomputed else None,
            weight=part(k, "weight") / runs,
        )
        for k in owners
    ]
    per_step = ("relay", "optimizer", "lightning in step", "between steps")  # each stage's work once per step
    optimizer = [sum(part(k, name) for name in per_step) for k in stages]
    loss = part(owners[-1], "loss")
    prediction = simulate(
        costs, args.chunks, args.checkpoint, loss=loss, optimizer=optimizer, schedule=args.schedule, virtual_stages=v
    )
    return 1e3 * prediction.step_time


if __name__ == "__main__":
    main()
