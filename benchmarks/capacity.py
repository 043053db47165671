"""The largest MLP that trains under a fixed per-process memory cap: plain Lightning against GPipe (Table 1's analogue).

The model is benchmarks/models.py's MLP, ``depth`` x (Linear(W, W), ReLU) + Linear(W, 10), built in
``configure_model``; SGD with momentum, so each Linear holds its weights, their gradients and a momentum buffer
(3 x 4 W^2 bytes). For each side the depth grows (doubling, then bisection) until two training steps fail
under the cap:

  plain  ``Trainer(accelerator="cpu", devices=1)``: 1 process
  gpipe  ``Trainer(strategy=GPipeStrategy(chunks=M, checkpoint=...), devices=K)``: K processes, each capped

The cap: every process runs under ``RLIMIT_DATA`` (set by the driver before ``exec``, inherited by the stage
processes Lightning's launcher starts), which bounds its private writable virtual memory: heap, anonymous
mappings (every large tensor), thread stacks. An allocation past the cap fails inside the process (torch raises
"can't allocate memory"), so the limit is exact and race-free, and it applies to each stage separately, like a
device's memory. It counts memory reserved but not yet touched, so it is a little stricter than resident memory;
each run also prints its processes' peak resident set size (VmHWM). A run that does not finish within
``--timeout`` seconds counts as a failure.

Usage::

    python benchmarks/capacity.py                          # cap 1536 MiB, W 2048, K 2, M 4, except_last
    python benchmarks/capacity.py --cap-mib 2048 --only gpipe
    python benchmarks/capacity.py --only gpipe --plan-reserve-mib 700   # GPipeStrategy(plan="auto") chooses
"""

import argparse

import _harness as harness

MIB = 2**20


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
    parser.add_argument("--only", nargs="+", choices=("plain", "gpipe"), default=["plain", "gpipe"])
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as failed")
    parser.add_argument(
        "--plan-reserve-mib",
        type=int,
        help="gpipe runs GPipeStrategy(plan='auto', memory_limit=cap - this many MiB) instead of the fixed chunks and"
        " checkpoint: the memory each process holds besides the model (Python, torch, Lightning, gloo)",
    )
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("cap_mib", "width", "batch_size", "devices", "chunks", "start"))
    return args


def attempt(args: argparse.Namespace, side: str, depth: int) -> bool:
    """Train ``depth`` pairs for two steps under the cap; print the outcome; True if every process trained.

    "trains": every process finished its steps (Lightning's ``on_train_end``); "fit returns": ``Trainer.fit``
    also came back, after the strategy's teardown (GPipeStrategy gathers the whole model on rank 0 there).
    """
    command = ["lightning", "--strategy", side, "--depth", str(depth), "--width", str(args.width)]
    command += ["--batch-size", str(args.batch_size), "--momentum", "0.9", "--steps", "1", "--warmup", "1"]
    command += ["--devices", str(args.devices), "--chunks", str(args.chunks), "--checkpoint", args.checkpoint]
    if side == "gpipe" and args.plan_reserve_mib is not None:
        command += ["--plan-limit-mib", str(args.cap_mib - args.plan_reserve_mib)]
    config = harness.Config(f"{side}/{depth}", command)
    outcome = harness.run(config, memory_cap=args.cap_mib * MIB, timeout=args.timeout)
    processes = args.devices if side == "gpipe" else 1
    trained = len(outcome.events) == processes
    returned = outcome.returncode == 0 and len(outcome.records) == processes
    params = depth * (args.width**2 + args.width) + args.width * 10 + 10
    rss = "/".join(f"{r['peak_rss_mib']:.0f}" for r in outcome.events) or "-"
    rss_end = "/".join(f"{r['peak_rss_mib']:.0f}" for r in outcome.records) or "-"
    verdict = "trains" if trained else "FAILS"
    verdict += ", fit returns" if returned else (", fit FAILS after training" if trained else "")
    why = "" if returned else f"  ({_cause(outcome.log)})"
    print(
        f"{side:<6} depth {depth:>4}  {params / 1e6:6.1f}M params  {verdict:<31} peak RSS {rss} MiB in training,"
        f" {rss_end} MiB at the end  {outcome.seconds:.0f} s{why}",
        flush=True,
    )
    return trained


def _cause(log: str) -> str:
    """The last line of a failed run's output that names an error, for the printout."""
    lines = [line.strip() for line in log.splitlines() if "Error" in line or "rror:" in line or "memory" in line]
    return lines[-1][:160] if lines else "no error message (killed or timed out)"


def largest(args: argparse.Namespace, side: str) -> int:
    """The largest depth that trains: double from ``--start`` until a failure, then bisect to within 1/8.

    Returns:
        0 if even ``--start`` fails.
    """
    good, bad = args.known_good, max(args.start, 2 * args.known_good)
    while attempt(args, side, bad):
        good, bad = bad, bad * 2
    while bad - good > max(1, good // 8):
        mid = (good + bad) // 2
        if attempt(args, side, mid):
            good = mid
        else:
            bad = mid
    return good


def main(argv: list[str] | None = None) -> None:
    """Search the largest trainable depth of each side and print the comparison."""
    args = parse_args(argv)
    harness.print_command(
        f"depth x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch"
        f" {args.batch_size}, SGD momentum 0.9, 2 steps; cap RLIMIT_DATA = {args.cap_mib} MiB per process;"
        f" gpipe: GPipeStrategy(chunks={args.chunks}, checkpoint={args.checkpoint!r}), devices={args.devices}"
    )
    print()

    def body() -> None:
        found = {side: largest(args, side) for side in args.only}
        print()
        per_pair = 4 * (args.width**2 + args.width) / MIB
        for side, depth in found.items():
            print(
                f"largest {side}: depth {depth} ({2 * depth} backbone layers), {depth * per_pair:.0f} MiB of weights"
                f" ({3 * depth * per_pair:.0f} MiB with gradients and momentum)"
            )
        if len(found) == 2 and found["plain"]:
            print(f"gpipe / plain: {found['gpipe'] / found['plain']:.2f}x the layers under the same per-process cap")

    harness.timed(body)


if __name__ == "__main__":
    main()
