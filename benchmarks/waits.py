"""What interruptible waits cost: the package's waits (a helper thread per process calls ``Work.wait()``; the main
thread waits on a lock that signals interrupt, and the stages' spans move the stall watchdog's position) against
plain blocking ``Work.wait()`` calls in the main thread, as before issue 15.

The same MLP, batch, M and initial weights for both modes (benchmarks/models.py, split by parameters, SGD,
``checkpoint="never"``); a small width by default, so that the per-wait cost weighs more than in real models.
For each M:

  E/blocking, E/interruptible   our engine (ModelChunk, Partition, Link) in K torch.distributed processes, no Trainer
  L/blocking, L/interruptible   GPipeStrategy through Lightning's Trainer, K processes

and once, independent of M:

  P/blocking, P/interruptible   a ping-pong of small messages between 2 processes, every transfer waited for at
                                once, no compute: the cost of one wait itself (a "step" is --rounds round trips)

The figure is rank 0's steady-state time per optimizer step; the ratio interruptible / blocking is the cost of the
interruptible waits (1.00 = none). Runs are interleaved fresh processes, so both modes see the same machine.

Usage::

    python benchmarks/waits.py                          # K=2, batch 512, width 512, M in {8, 32}, 5 repeats
    python benchmarks/waits.py --repeats 3 --steps 4    # a quick look
    python benchmarks/waits.py --only P --repeats 7     # the cost of one wait alone
    python benchmarks/waits.py --only E L --schedule 1f1b   # under 1F1B
"""

import argparse

import _harness as harness
import _waits_run

KINDS = {"E": ("bare", "our engine without the Trainer"), "L": ("lightning", "GPipeStrategy through the Trainer")}
PING_PONG = "P"
"""The label of the ping-pong measurement (the cost of one wait, without compute)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="K, stages (default 2)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 32], help="values of M (default 8 32)")
    parser.add_argument("--batch-size", type=int, default=512, help="rows per mini-batch (default 512)")
    parser.add_argument("--width", type=int, default=512, help="features per Linear layer (default 512)")
    parser.add_argument("--depth", type=int, default=8, help="(Linear, ReLU) pairs (default 8)")
    parser.add_argument(
        "--only", nargs="+", choices=(*KINDS, PING_PONG), default=[*KINDS, PING_PONG], help="what to run"
    )
    parser.add_argument("--rounds", type=int, default=200, help="ping-pong round trips per measured step (200)")
    parser.add_argument("--schedule", default="gpipe", help="the pipelines' schedule (default gpipe: fill-drain)")
    harness.add_timing_args(parser, repeats=5, steps=10)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth", "repeats", "rounds"))
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """One configuration per (M, pipeline, mode), and the ping-pong's per mode."""
    common = harness.mlp_run_args(args)
    result = []
    if PING_PONG in args.only:
        timing = ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--steps", str(args.steps)]
        for mode in _waits_run.MODES:
            describe = f"ping-pong of 16 floats, {args.rounds} round trips per step, {mode} waits"
            result.append(harness.Config(f"P/{mode}", [mode, "pingpong", *timing], nprocs=2, describe=describe))
    for m in args.chunks:
        for label in args.only:
            if label == PING_PONG:
                continue
            kind, describe = KINDS[label]
            for mode in _waits_run.MODES:
                result.append(
                    harness.Config(
                        f"{label}/{mode}/M{m}",
                        [mode, kind, *common, "--chunks", str(m), "--checkpoint", "never", "--schedule", args.schedule],
                        nprocs=1 if kind == "lightning" else args.devices,
                        describe=f"{describe}, {mode} waits, K={args.devices}, M={m}, {args.schedule}",
                    )
                )
    return result


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the ratios."""
    args = parse_args(argv)
    harness.RUNS = _waits_run.__file__  # each measurement goes through the mode switch
    settings = (
        f"{args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch"
        f" {args.batch_size}, SGD, K={args.devices}, checkpoint never; {args.warmup} warm-up + {args.steps} measured"
        f" steps per run; {args.repeats} interleaved repeats"
    )
    harness.drive(settings, configs(args), args, lambda results: summarise(args, results))


def summarise(args: argparse.Namespace, results: dict[str, harness.Series]) -> None:
    """For each M and pipeline: interruptible over blocking (1.00: the interruptible waits cost nothing); for the
    ping-pong, also the cost of one wait in microseconds (four waits per round trip)."""
    if PING_PONG in args.only:
        a, b = results[f"P/{_waits_run.MODES[0]}"], results[f"P/{_waits_run.MODES[1]}"]
        harness.print_ratio("cost of interruptible waits, ping-pong", a, b, "P/interruptible", "P/blocking")
        extra = (a.median() - b.median()) / (4 * args.rounds) * 1e6
        print(
            f"    extra time per wait: ({a.median():.4f} - {b.median():.4f}) s / (4 x {args.rounds}) = {extra:.1f} us"
        )
    for m in args.chunks:
        for label in args.only:
            if label == PING_PONG:
                continue
            a, b = f"{label}/interruptible/M{m}", f"{label}/blocking/M{m}"
            harness.print_ratio(f"cost of interruptible waits, {label}, M={m}", results[a], results[b], a, b)


if __name__ == "__main__":
    main()
