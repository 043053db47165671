"""The largest model that trains under a fixed per-process memory cap: plain Lightning, each of our schedules (with
and without activation offload) and torch.distributed.pipelining's schedules (GPipe's Table 1 analogue).

The model (``--model``): benchmarks/models.py's MLP, ``depth`` x (Linear(W, W), ReLU) + Linear(W, 10), built in
``configure_model``, SGD with momentum (each Linear holds its weights, their gradients and a momentum buffer:
3 x 4 W^2 bytes); or the translation example's Transformer with ``depth`` encoder and ``depth`` decoder layers
(d_model 256, its first batch of ``--max-tokens`` padded tokens per side). For each side (configuration) the depth
grows (doubling, then bisection to within 1/8) until two training steps fail under the cap; the side's step time
at that depth (the second step, rank 0's) is printed beside it. Sides (``--only``; default all of the model's):

  plain          ``Trainer(accelerator="cpu", devices=1)``: 1 process
  gpipe, 1f1b, zb-h1, zb-1p, zb-v, v-min, v-half, v-zb
                 ``Trainer(strategy=GPipeStrategy(chunks=M, checkpoint=..., schedule=...), devices=K)``: K processes
  1f1b+offload   the same with ``schedule="1f1b", offload="activations"``
  torch-gpipe, torch-1f1b, torch-i1f1b, torch-zb, torch-zbv (MLP only)
                 ``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
                 ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble over K processes (each rank builds only
                 its own layers; torch's schedules have no re-materialization); the best of them is printed

The cap: every process runs under ``RLIMIT_DATA`` (set by the driver before ``exec``, inherited by the stage
processes Lightning's launcher starts), which bounds its private writable virtual memory: heap, anonymous
mappings (every large tensor), thread stacks. An allocation past the cap fails inside the process (torch raises
"can't allocate memory"), so the limit is exact and race-free, and it applies to each stage separately, like a
device's memory. It counts memory reserved but not yet touched, so it is a little stricter than resident memory;
each run also prints its processes' peak resident set size (VmHWM). A run that does not finish within
``--timeout`` seconds counts as a failure. On a CPU, ``offload="activations"`` moves nothing (host memory is the
device's), so its capacity is 1F1B's: the side shows that, and the GPU check measures what it saves.

Usage::

    python benchmarks/capacity.py                          # cap 1536 MiB, W 2048, K 2, M 4, except_last, every side
    python benchmarks/capacity.py --cap-mib 2048 --only gpipe
    python benchmarks/capacity.py --devices 4 --width 256 --batch-size 4096 --cap-mib 768 --checkpoint never
    python benchmarks/capacity.py --model translation --max-tokens 2048 --only plain gpipe 1f1b v-min
    python benchmarks/capacity.py --only gpipe --plan-reserve-mib 700   # GPipeStrategy(plan="auto") chooses
"""

import argparse

import _harness as harness

MIB = 2**20
OURS = ("gpipe", "1f1b", "zb-h1", "zb-1p", "zb-v", "v-min", "v-half", "v-zb")
"""Our schedules, each a side under its name."""
TORCH = {
    "torch-gpipe": "tp",
    "torch-1f1b": "tp-1f1b",
    "torch-i1f1b": "tp-i1f1b",
    "torch-zb": "tp-zb",
    "torch-zbv": "tp-zbv",
}
"""torch.distributed.pipelining's schedules, each a side, and the ``benchmarks/_runs.py`` kind that runs it."""
SIDES = ("plain", *OURS, "1f1b+offload", *TORCH)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-mib", type=int, default=1536, help="RLIMIT_DATA of every process, MiB (default 1536)")
    parser.add_argument("--width", type=int, default=2048, help="W, features per Linear layer (default 2048)")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per mini-batch (default 64)")
    parser.add_argument("--devices", type=int, default=2, help="K, GPipe stages (default 2)")
    parser.add_argument("--chunks", type=int, default=4, help="M, micro-batches (default 4)")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="except_last")
    parser.add_argument("--start", type=int, default=4, help="first depth tried, (Linear, ReLU) pairs (default 4)")
    parser.add_argument("--known-good", type=int, default=0, help="a depth known to train, to resume a search")
    parser.add_argument("--model", choices=("mlp", "translation"), default="mlp", help="the model family (default mlp)")
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="translation: padded tokens per side of its batch (default 4096)"
    )
    parser.add_argument("--only", nargs="+", choices=SIDES, help="the sides to measure (default: all of the model's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as failed")
    parser.add_argument(
        "--plan-reserve-mib",
        type=int,
        help="gpipe runs GPipeStrategy(plan='auto', memory_limit=cap - this many MiB) instead of the fixed chunks and"
        " checkpoint: the memory each process holds besides the model (Python, torch, Lightning, gloo)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("cap_mib", "width", "batch_size", "devices", "chunks", "start"))
    if args.only is None:
        args.only = [side for side in SIDES if args.model == "mlp" or side not in TORCH]
    elif args.model != "mlp" and set(args.only) & set(TORCH):
        parser.error("torch's schedules run the MLP only")
    return args


def _command(args: argparse.Namespace, side: str, depth: int) -> harness.Config:
    """The configuration of one run of ``side`` at ``depth``."""
    model = [
        "--model",
        args.model,
        "--depth",
        str(depth),
        "--steps",
        "1",
        "--warmup",
        "1",
        "--chunks",
        str(args.chunks),
    ]
    if args.model == "mlp":
        model += ["--width", str(args.width), "--batch-size", str(args.batch_size), "--momentum", "0.9"]
    else:
        model += ["--max-tokens", str(args.max_tokens)]
    model += ["--devices", str(args.devices)]
    if side in TORCH:
        return harness.Config(f"{side}/{depth}", [TORCH[side], *model, "--local-layers"], nprocs=args.devices)
    command = ["lightning", "--strategy", "plain" if side == "plain" else "gpipe", *model]
    if side != "plain":
        command += ["--checkpoint", args.checkpoint, "--schedule", side.removesuffix("+offload")]
        command += ["--offload"] if side.endswith("+offload") else []
        if args.plan_reserve_mib is not None:
            command += ["--plan-limit-mib", str(args.cap_mib - args.plan_reserve_mib)]
    return harness.Config(f"{side}/{depth}", command)


def _params(args: argparse.Namespace, depth: int) -> float:
    """Millions of parameters of the MLP at ``depth`` (``nan`` for the translation model, whose size the run does not
    report)."""
    if args.model != "mlp":
        return float("nan")
    return (depth * (args.width**2 + args.width) + args.width * 10 + 10) / 1e6


def attempt(args: argparse.Namespace, side: str, depth: int) -> float | None:
    """Train ``depth`` for two steps under the cap; print the outcome; the second step's seconds (rank 0's) if every
    process trained, else ``None``.

    "trains": every process finished its steps (Lightning's ``on_train_end``; torch's runs: the process's record);
    "fit returns": ``Trainer.fit`` also came back, after the strategy's teardown (GPipeStrategy gathers the whole
    model on rank 0 there).
    """
    outcome = harness.run(_command(args, side, depth), memory_cap=args.cap_mib * MIB, timeout=args.timeout)
    processes = 1 if side == "plain" else args.devices
    returned = outcome.returncode == 0 and len(outcome.records) == processes
    trained = len(outcome.events) == processes or (side in TORCH and returned)
    rss = "/".join(f"{r['peak_rss_mib']:.0f}" for r in outcome.events) or "-"
    rss_end = "/".join(f"{r['peak_rss_mib']:.0f}" for r in outcome.records) or "-"
    verdict = "trains" if trained else "FAILS"
    verdict += ", fit returns" if returned else (", fit FAILS after training" if trained else "")
    why = "" if returned else f"  ({_cause(outcome.log)})"
    print(
        f"{side:<13} depth {depth:>4}  {_params(args, depth):6.1f}M params  {verdict:<31} peak RSS {rss} MiB in"
        f" training, {rss_end} MiB at the end  {outcome.seconds:.0f} s{why}",
        flush=True,
    )
    if not trained:
        return None
    return outcome.records[0]["median_s"] if returned else float("nan")


def _cause(log: str) -> str:
    """The last line of a failed run's output that names an error, for the printout."""
    lines = [line.strip() for line in log.splitlines() if "Error" in line or "rror:" in line or "memory" in line]
    return lines[-1][:160] if lines else "no error message (killed or timed out)"


def largest(args: argparse.Namespace, side: str) -> tuple[int, float]:
    """The largest depth that trains, and its step in seconds: double from ``--start`` until a failure, then bisect
    to within 1/8.

    Returns:
        ``(0, nan)`` if even ``--start`` fails.
    """
    good, bad, step = args.known_good, max(args.start, 2 * args.known_good), float("nan")
    while (seconds := attempt(args, side, bad)) is not None:
        good, bad, step = bad, bad * 2, seconds
    while bad - good > max(1, good // 8):
        mid = (good + bad) // 2
        if (seconds := attempt(args, side, mid)) is not None:
            good, step = mid, seconds
        else:
            bad = mid
    return good, step


def main(argv: list[str] | None = None) -> None:
    """Search the largest trainable depth of each side and print the comparison."""
    args = parse_args(argv)
    model = (
        f"depth x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch {args.batch_size},"
        " SGD momentum 0.9"
        if args.model == "mlp"
        else f"translation Transformer, depth encoder + depth decoder layers, {args.max_tokens} tokens per side"
    )
    harness.print_command(
        f"{model}, 2 steps; cap RLIMIT_DATA = {args.cap_mib} MiB per process; ours: GPipeStrategy(chunks="
        f"{args.chunks}, checkpoint={args.checkpoint!r}, schedule=side), devices={args.devices}; torch's: M="
        f"{args.chunks}, no re-materialization"
    )
    print()

    def body() -> None:
        found = {side: largest(args, side) for side in args.only}
        print(f"\n{'side':<13}{'largest depth':>14}{'x plain':>9}{'step s':>8}")
        plain = found.get("plain", (0, 0.0))[0]
        for side, (depth, step) in found.items():
            ratio = f"{depth / plain:.2f}" if plain else "-"
            print(f"{side:<13}{depth:>14}{ratio:>9}{step:>8.2f}")
        torch_sides = {side: found[side] for side in found if side in TORCH}
        our_sides = {side: found[side] for side in found if side not in TORCH and side != "plain"}
        if torch_sides and our_sides:
            best = max(torch_sides, key=lambda side: torch_sides[side][0])
            ours = max(our_sides, key=lambda side: our_sides[side][0])
            print(
                f"best of ours: {ours} at depth {found[ours][0]}; best of torch's: {best} at depth"
                f" {found[best][0]} ({found[ours][0] / max(found[best][0], 1):.2f}x)"
            )

    harness.timed(body)


if __name__ == "__main__":
    main()
