"""What the check that every stage read the same batch costs: GPipeStrategy with the batch fingerprints taken and
compared in each step's agreement (:mod:`lightning_gpipe.lightning.agreement`) against the same runs without them
(the agreement's all-reduce stays: it carries the stop requests and the logged values' relay).

The benchmark MLP (benchmarks/models.py, 8 x Linear(1024) by default, batch 1024, split by parameters, SGD,
``checkpoint="never"``) through Lightning's Trainer, K processes, M micro-batches. The figure is rank 0's
steady-state time per optimizer step; the ratio agreeing / trusting is the cost of the check (1.00 = none). Runs are
interleaved fresh processes, so both modes see the same machine.

Usage::

    python benchmarks/agreement.py                          # K=2, M=8, 5 repeats
    python benchmarks/agreement.py --repeats 3 --steps 4    # a quick look
"""

import argparse

import _agreement_run
import _harness as harness


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="K, stages (default 2)")
    parser.add_argument("--chunks", type=int, default=8, help="M (default 8)")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="features per Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="(Linear, ReLU) pairs (default 8)")
    harness.add_timing_args(parser, repeats=5, steps=8)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth", "repeats"))
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """One configuration per mode."""
    common = [*harness.mlp_run_args(args), "--chunks", str(args.chunks), "--checkpoint", "never"]
    return [
        harness.Config(mode, [mode, "lightning", *common], nprocs=1, describe=f"GPipeStrategy, {mode}")
        for mode in _agreement_run.MODES
    ]


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the ratio."""
    args = parse_args(argv)
    harness.RUNS = _agreement_run.__file__  # each measurement goes through the mode switch
    settings = (
        f"{args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), batch"
        f" {args.batch_size}, SGD, K={args.devices}, M={args.chunks}, checkpoint never; {args.warmup} warm-up +"
        f" {args.steps} measured steps per run; {args.repeats} interleaved repeats"
    )

    def summarise(results: dict[str, harness.Series]) -> None:
        harness.print_ratio("cost of the agreement", results["agreeing"], results["trusting"], "agreeing", "trusting")

    harness.drive(settings, configs(args), args, summarise)


if __name__ == "__main__":
    main()
