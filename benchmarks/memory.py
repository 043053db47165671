"""Peak activation memory per stage for each schedule and re-materialization mode, against the formulas.

For K stages and M micro-batches, each configuration is one ``Trainer.fit`` of the balanced MLP
(benchmarks/models.py) under ``GPipeStrategy(chunks=M, checkpoint=mode, schedule=schedule)`` with ``devices=K``.
In every stage process, ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes of the tensors autograd
saves for backward (each storage once, parameters excluded), live and at their peak over the steps; at every
saved tensor and at the end of each fill, it also counts the micro-batch inputs the stage keeps for
re-computation that autograd does not hold, so ``peak`` is the largest sum of both seen. The process's resident
set is measured too: its peak during ``fit`` over its size when training starts (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``), gradients, optimizer state and transfer buffers included; every allocation of
64 KiB or more gets its own mapping, returned to the system when freed (glibc's ``mallopt``), so the resident set
follows the live tensors rather than the allocator's cache.

The formulas. GPipe's fill-drain (Huang et al. 2019, section 2.2) holds all M micro-batches: with
re-materialization, peak activation memory per stage is O(N + L/K * N/M) (the stage inputs of every
micro-batch, plus one micro-batch's activations through the stage's L/K layers); without it, O(N * L/K). 1F1B
(PipeDream-Flush, Narayanan et al. 2021) holds at most h = min(K - k, M) micro-batches on stage k: h N/M L/K
without re-materialization, h N/M + L/K N/M with ``"always"``, h N/M + min(h, 2) L/K N/M with ``"except_last"``
(the last micro-batch keeps its activations while the others are recomputed). Here one "layer" is a (Linear,
ReLU) pair, which saves one W-wide row per sample (its input; the ReLU's output is the next pair's input), so
the predictions in bytes are these counts of rows times 4 W. The first stage's micro-batch inputs are views of
the batch, so its inputs count N rows under both schedules (the batch is held anyway). The ratio measured /
predicted should stay near a constant across K, M and the schedules.

Byte counts do not depend on the machine's load: each configuration runs once.

Usage::

    python benchmarks/memory.py                              # K in {1, 2}, M in {1, 2, 4, 8}, all modes, both schedules
    python benchmarks/memory.py --devices 2 --chunks 4 8 --checkpoint except_last --schedule 1f1b
    python benchmarks/memory.py --devices 2 --chunks 16 --checkpoint never --batch-size 4096   # 1F1B's headline
"""

import argparse

import _harness as harness

MIB = 2**20
SCHEDULES = ("gpipe", "1f1b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="values of K (default 1 2)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8], help="values of M (default 1 2 4 8)")
    modes = ("never", "except_last", "always")
    parser.add_argument("--checkpoint", nargs="+", choices=modes, default=list(modes), help="modes (default all)")
    parser.add_argument("--schedule", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="default both")
    parser.add_argument("--batch-size", type=int, default=1024, help="N, rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="W, features per Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="L, (Linear, ReLU) pairs (default 8)")
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth"))
    return args


def predicted_bytes(args: argparse.Namespace, k: int, m: int, mode: str, schedule: str, stage: int) -> float:
    """The formulas' activation memory of ``stage`` in bytes (see the module docstring; the constant factors are
    ours: one saved row per layer and sample)."""
    rows, layers = args.batch_size / m, args.depth / k
    held = m if schedule == "gpipe" else min(k - stage, m)
    inputs = args.batch_size if stage == 0 else held * rows  # the first stage's inputs are views of the batch
    if mode == "never" or (mode == "except_last" and m == 1):
        return 4 * args.width * (inputs + held * rows * (layers - 1))
    computed = 1 if mode == "always" or schedule == "gpipe" else min(held, 2)
    return 4 * args.width * (inputs + computed * layers * rows)


def measure(args: argparse.Namespace, k: int, m: int, mode: str, schedule: str) -> list[dict]:
    """One fit of two steps; the records of the K stage processes."""
    command = ["lightning", "--devices", str(k), "--chunks", str(m), "--checkpoint", mode, "--schedule", schedule]
    command += ["--batch-size", str(args.batch_size), "--width", str(args.width), "--depth", str(args.depth)]
    command += ["--count-saved", "--steps", "1", "--warmup", "1"]
    return harness.run_or_exit(harness.Config(f"K{k}/M{m}/{mode}/{schedule}", command)).records


def main(argv: list[str] | None = None) -> None:
    """Measure every (K, M, mode, schedule) and print bytes and ratios per stage, then 1F1B over fill-drain."""
    args = parse_args(argv)
    harness.print_command(
        f"{args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch"
        f" N={args.batch_size}, fp32; GPipeStrategy(chunks=M, checkpoint=mode, schedule=...), devices=K;"
        " 2 steps per fit"
    )
    print(
        "columns:  saved = peak bytes autograd held (saved_tensors_hooks); kept = most micro-batch inputs kept for"
        " re-computation outside autograd; peak = largest saved + kept seen; predicted = the formulas (module"
        " docstring); ratio = peak / predicted; RSS+ = peak resident set during fit over its size at the start"
    )
    print()
    print(
        f"{'K':>2} {'M':>3} {'schedule':<9}{'mode':<12}{'stage':>6}{'saved MiB':>11}{'kept MiB':>10}"
        f"{'peak MiB':>10}{'predicted':>11}{'ratio':>7}{'RSS+ MiB':>10}"
    )
    measured: dict[tuple, list[dict]] = {}

    def body() -> None:
        for k in args.devices:
            for mode in args.checkpoint:
                for m in args.chunks:
                    for schedule in args.schedule:
                        records = measured[k, m, mode, schedule] = measure(args, k, m, mode, schedule)
                        for r in records:
                            predicted = predicted_bytes(args, k, m, mode, schedule, r["rank"])
                            print(
                                f"{k:>2} {m:>3} {schedule:<9}{mode:<12}{r['rank']:>6}{r['saved_peak'] / MIB:>11.1f}"
                                f"{r['kept_inputs'] / MIB:>10.1f}{r['peak'] / MIB:>10.1f}{predicted / MIB:>11.1f}"
                                f"{r['peak'] / predicted:>7.2f}{r['rss_growth_mib']:>10.0f}",
                                flush=True,
                            )
        print_one_f_one_b_over_fill_drain(args, measured)

    harness.timed(body)


def print_one_f_one_b_over_fill_drain(args: argparse.Namespace, measured: dict[tuple, list[dict]]) -> None:
    """For every (K, M, mode) measured with both schedules: per stage, 1F1B's peak activation bytes (and the
    formulas' ratio) and resident set growth during fit over fill-drain's."""
    pairs = [key[:3] for key in measured if key[3] == "gpipe" and (*key[:3], "1f1b") in measured]
    if not pairs:
        return
    print()
    print("1F1B / fill-drain, per stage: peak activation bytes (the formulas' ratio); resident set growth during fit")
    for k, m, mode in pairs:
        for fill, one in zip(measured[k, m, mode, "gpipe"], measured[k, m, mode, "1f1b"]):
            stage = fill["rank"]
            one_formula, fill_formula = (predicted_bytes(args, k, m, mode, s, stage) for s in ("1f1b", "gpipe"))
            formula = one_formula / fill_formula
            print(
                f"K={k} M={m} {mode:<12} stage {stage}: peak {one['peak'] / fill['peak']:.3f} (formulas"
                f" {formula:.3f}); RSS growth {one['rss_growth_mib']:.0f} / {fill['rss_growth_mib']:.0f} MiB ="
                f" {one['rss_growth_mib'] / fill['rss_growth_mib']:.3f}"
            )


if __name__ == "__main__":
    main()
