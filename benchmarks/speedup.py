"""Speed-up of GPipeStrategy over plain Lightning for K stages and M micro-batches (GPipe's Table 2, on CPU).

Configurations, each a fresh ``Trainer.fit`` with one torch thread per process:

  A      plain Lightning, ``Trainer(accelerator="cpu", devices=1)``: 1 process
  KK/MM  ``Trainer(strategy=GPipeStrategy(chunks=M, checkpoint=...), devices=K)``: K processes; K = 1 is
         micro-batching and re-materialization alone, in one process
  KK/MM/1f1b  the same with ``schedule="1f1b"`` (PipeDream-Flush, Narayanan et al. 2021): the same bubble, so the
         same time is expected; ``1f1b over fill-drain`` lines give median(KK/MM/1f1b) / median(KK/MM)

Models (``--model``): the balanced MLP of benchmarks/models.py (8 x (Linear(1024, 1024), ReLU), batch 1024) or
the AmoebaNet-D (6, 16) example on 32 x 32 images (batch 32, as in its CPU config). Every stage gets the plain
run's CPU budget (one thread), so median(A) / median(KK/MM) is the speed-up; the ideal is K * M / (M + K - 1),
before transfers, the head and the optimizer step. The figure is rank 0's steady-state time between
``on_train_batch_end`` calls; the runs are interleaved (A, K1/M1, ..., A, ...) and medians compared.

Usage::

    python benchmarks/speedup.py                          # MLP, K in {1, 2}, M in {1, 2, 4, 8, 16}
    python benchmarks/speedup.py --model amoebanet        # AmoebaNet-D (6, 16), batch 32
    python benchmarks/speedup.py --model amoebanet --devices 2 --balance time   # split by profiled time
    python benchmarks/speedup.py --devices 2 --chunks 8 --checkpoint except_last --repeats 5
    python benchmarks/speedup.py --devices 2 --chunks 16 --schedule gpipe 1f1b   # 1F1B against fill-drain
"""

import argparse
import statistics

import _harness as harness

DEFAULT_BATCH = {"mlp": 1024, "amoebanet": 32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "amoebanet"), default="mlp")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="values of K (default 1 2)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="values of M")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    parser.add_argument("--balance", choices=("params", "time", "memory"), default="params", help="GPipe balance")
    parser.add_argument(
        "--schedule", nargs="+", choices=("gpipe", "1f1b"), default=["gpipe", "1f1b"], help="default both"
    )
    parser.add_argument("--batch-size", type=int, help="rows per mini-batch (default 1024 MLP, 32 AmoebaNet)")
    harness.add_timing_args(parser)
    args = parser.parse_args(argv)
    args.batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "repeats", "warmup"))
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """A, then one GPipe configuration per (K, M)."""
    common = ["lightning", "--model", args.model, "--batch-size", str(args.batch_size)]
    common += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    result = [harness.Config("A", [*common, "--strategy", "plain"], describe="plain Lightning, 1 process x 1 thread")]
    for k in args.devices:
        for m in args.chunks:
            for schedule in args.schedule:
                result.append(
                    harness.Config(
                        _name(k, m, schedule),
                        [*common, "--devices", str(k), "--chunks", str(m), "--checkpoint", args.checkpoint]
                        + ["--balance", args.balance, "--schedule", schedule],
                        describe=f"GPipeStrategy(balance={args.balance!r}, chunks={m}, checkpoint={args.checkpoint!r},"
                        f" schedule={schedule!r}), devices={k}:"
                        f" {k} process(es) x 1 thread, micro-batches of ~{-(-args.batch_size // m)}",
                    )
                )
    return result


def _name(k: int, m: int, schedule: str) -> str:
    return f"K{k}/M{m}" + ("/1f1b" if schedule == "1f1b" else "")


def summarise(args: argparse.Namespace, results: dict[str, harness.Series]) -> None:
    """Print the speed-up grid (rows K, columns M) and each configuration's ratio line."""
    plain = results["A"]
    for name in results:
        if name != "A":
            harness.print_ratio(f"speedup {name}", plain, results[name], "A", name)
    if set(args.schedule) == {"gpipe", "1f1b"}:
        print()
        for k in args.devices:
            for m in args.chunks:
                a, b = _name(k, m, "1f1b"), _name(k, m, "gpipe")
                harness.print_ratio(f"1f1b over fill-drain K{k}/M{m}", results[a], results[b], a, b)
    for schedule in args.schedule:
        print()
        print(
            f"speed-up over plain Lightning, schedule={schedule!r}: median(A) / median(K/M); ideal K*M/(M+K-1) in"
            " brackets"
        )
        print(f"{'':<4}" + "".join(f"{'M=' + str(m):>14}" for m in args.chunks))
        for k in args.devices:
            cells = []
            for m in args.chunks:
                ratio = plain.median() / results[_name(k, m, schedule)].median()
                cells.append(f"{ratio:.2f}x ({k * m / (m + k - 1):.2f})")
            print(f"K={k:<2}" + "".join(f"{c:>14}" for c in cells))
    busiest = {name: statistics.median(s.busiest_cpu) for name, s in results.items()}
    print()
    print("CPU s/step of the busiest process (median):", ", ".join(f"{n} {v:.3f}" for n, v in busiest.items()))
    print()
    print(
        "CPU-time estimate (a model, not a measurement): the speed-up if every process had its own CPU,"
        " cpu(A) / (cpu(busiest stage) * (M+K-1)/M)"
    )
    print(f"{'':<4}" + "".join(f"{'M=' + str(m):>14}" for m in args.chunks))
    for schedule in args.schedule:
        for k in args.devices:
            cells = [busiest["A"] / (busiest[_name(k, m, schedule)] * (m + k - 1) / m) for m in args.chunks]
            print(f"K={k:<2}" + "".join(f"{c:>13.2f}x" for c in cells) + f"  {schedule}")


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the tables."""
    args = parse_args(argv)
    grid = configs(args)
    model = (
        "8 x (Linear(1024, 1024), ReLU) + Linear(1024, 10)"
        if args.model == "mlp"
        else "AmoebaNet-D (6, 16), 32 x 32 images"
    )
    settings = (
        f"{model}, cross-entropy, batch {args.batch_size}, SGD; {args.warmup} warm-up + {args.steps} measured"
        f" steps per run; {args.repeats} interleaved repeats"
    )
    harness.drive(settings, grid, args, lambda results: summarise(args, results))


if __name__ == "__main__":
    main()
