"""Images per second of AmoebaNet-D (6, 16) training on 2 pipeline stages, by batch size, chunks and balance.

Each configuration is a fresh ``Trainer.fit`` of the example's module under ``GPipeStrategy`` on 2 processes of
one thread each, on random 32 x 32 images (``benchmarks/_runs.py lightning --model amoebanet``), so the data
pipeline is left out. Configurations are named ``BATCH/CHUNKS/BALANCE`` (micro-batches of BATCH / CHUNKS images),
with ``/cl`` for the ``channels_last`` memory format (``AmoebaNetClassifier(channels_last=True)``);
they run interleaved and the figure is ``BATCH / median(s/step)`` of rank 0's steady-state steps, with each
configuration's images/s over the first one's.

Usage::

    python benchmarks/amoebanet_pipeline.py                                   # 32/8/params 128/4/params 128/4/time
    python benchmarks/amoebanet_pipeline.py --configs 32/8/params 128/4/time 128/4/time/cl --repeats 3
"""

import argparse
import statistics

import _harness as harness


def config(name: str, args: argparse.Namespace) -> harness.Config:
    """The measurement ``BATCH/CHUNKS/BALANCE[/cl]`` on 2 stages."""
    batch, chunks, balance, *memory_format = name.split("/")
    run = ["lightning", "--model", "amoebanet", "--devices", "2", "--batch-size", batch, "--chunks", chunks]
    run += ["--balance", balance, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    run += ["--channels-last"] if memory_format == ["cl"] else []
    describe = f"GPipeStrategy(chunks={chunks}, balance={balance!r}), devices=2, batch {batch}"
    describe += ", channels_last" if memory_format == ["cl"] else ""
    return harness.Config(name, run, describe=f"{describe}: micro-batches of ~{-(-int(batch) // int(chunks))} images")


def main() -> None:
    """Run the interleaved measurements and print the images/s table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["32/8/params", "128/4/params", "128/4/time"])
    harness.add_timing_args(parser, repeats=2, steps=4, warmup=2)
    args = parser.parse_args()
    configs = [config(name, args) for name in args.configs]

    def summarise(results: dict[str, harness.Series]) -> None:
        first = None
        print(f"{'config':<16} {'images/s (median)':>18} {'vs first':>9}   per repeat")
        for name, series in results.items():
            batch = int(name.split("/")[0])
            rate = batch / series.median()
            first = first or rate
            cells = ", ".join(f"{batch / seconds:.1f}" for seconds in series.medians)
            print(f"{name:<16} {rate:>18.1f} {rate / first:>8.2f}x   {cells}")
        cpu = {name: statistics.median(series.busiest_cpu) for name, series in results.items()}
        print("CPU s/step of the busiest process (median):", ", ".join(f"{n} {v:.3f}" for n, v in cpu.items()))

    settings = f"AmoebaNet-D (6, 16), random 32 x 32 images, SGD; {args.warmup} warm-up + {args.steps} measured steps"
    harness.drive(f"{settings}; {args.repeats} interleaved repeats", configs, args, summarise)


if __name__ == "__main__":
    main()
