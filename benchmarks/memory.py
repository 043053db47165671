"""Peak activation memory per stage for each re-materialization mode, against GPipe's O(N + L/K * N/M).

For K stages and M micro-batches, each configuration is one ``Trainer.fit`` of the balanced MLP
(benchmarks/models.py) under ``GPipeStrategy(chunks=M, checkpoint=mode)`` with ``devices=K``. In every stage
process, ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes of the tensors autograd saves for
backward (each storage once, parameters excluded), live and at their peak over the steps; and, at the end of
each fill, the bytes of the micro-batch inputs the stage keeps for re-computation that autograd does not hold.

The paper (Huang et al. 2019, section 2.2): with re-materialization, peak activation memory per stage is
O(N + L/K * N/M) (the stage inputs of every micro-batch, plus one micro-batch's activations through the
stage's L/K layers); without it, O(N * L/K). Here one "layer" is a (Linear, ReLU) pair, which saves one
W-wide row per sample (its input; the ReLU's output is the next pair's input), so the predictions in bytes are
4 W (N + L/K * N/M) and 4 W N L/K. The ratio measured / predicted should stay near a constant across K and M.

Byte counts do not depend on the machine's load: each configuration runs once.

Usage::

    python benchmarks/memory.py                              # K in {1, 2}, M in {1, 2, 4, 8}, all modes
    python benchmarks/memory.py --devices 2 --chunks 4 8 --checkpoint except_last
"""

import argparse

import _harness as harness

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="values of K (default 1 2)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="values of M (default 1 2 4 8)")
    modes = ("never", "except_last", "always")
    parser.add_argument("--checkpoint", nargs="+", choices=modes, default=list(modes), help="modes (default all)")
    parser.add_argument("--batch-size", type=int, default=1024, help="N, rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="W, features per Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="L, (Linear, ReLU) pairs (default 8)")
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth"))
    return args


def predicted_bytes(args: argparse.Namespace, k: int, m: int, mode: str) -> float:
    """The paper's activation memory per stage in bytes: 4 W N L/K without re-materialization,
    4 W (N + L/K * N/M) with it (the constant factors are ours: one saved row per layer and sample)."""
    n, w, layers = args.batch_size, args.width, args.depth / k
    if mode == "never" or (mode == "except_last" and m == 1):
        return 4 * w * n * layers
    return 4 * w * (n + layers * n / m)


def measure(args: argparse.Namespace, k: int, m: int, mode: str) -> list[dict]:
    """One fit of two steps; the records of the K stage processes."""
    command = ["lightning", "--devices", str(k), "--chunks", str(m), "--checkpoint", mode, "--count-saved"]
    command += ["--batch-size", str(args.batch_size), "--width", str(args.width), "--depth", str(args.depth)]
    command += ["--steps", "1", "--warmup", "1"]
    return harness.run_or_exit(harness.Config(f"K{k}/M{m}/{mode}", command)).records


def main(argv: list[str] | None = None) -> None:
    """Measure every (K, M, mode) and print bytes and ratios per stage."""
    args = parse_args(argv)
    harness.print_command(
        f"{args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch"
        f" N={args.batch_size}, fp32; GPipeStrategy(chunks=M, checkpoint=mode), devices=K; 2 steps per fit"
    )
    print(
        "columns:  saved = peak bytes autograd held (saved_tensors_hooks); kept = micro-batch inputs kept for"
        " re-computation at the end of the fill, outside autograd; sum = saved + kept (an upper bound of the"
        " peak); predicted = 4 W (N + L/K N/M) with re-materialization, 4 W N L/K without; RSS = peak resident"
        " set of the stage process"
    )
    print()
    print(
        f"{'K':>2} {'M':>3} {'mode':<12}{'stage':>6}{'saved MiB':>11}{'kept MiB':>10}{'sum MiB':>9}"
        f"{'predicted':>11}{'ratio':>7}{'RSS MiB':>9}"
    )

    def body() -> None:
        for k in args.devices:
            for mode in args.checkpoint:
                for m in args.chunks:
                    predicted = predicted_bytes(args, k, m, mode)
                    for r in measure(args, k, m, mode):
                        total = r["saved_peak"] + r["kept_inputs"]
                        print(
                            f"{k:>2} {m:>3} {mode:<12}{r['rank']:>6}{r['saved_peak'] / MIB:>11.1f}"
                            f"{r['kept_inputs'] / MIB:>10.1f}{total / MIB:>9.1f}{predicted / MIB:>11.1f}"
                            f"{total / predicted:>7.2f}{r['peak_rss_mib']:>9.0f}",
                            flush=True,
                        )

    harness.timed(body)


if __name__ == "__main__":
    main()
