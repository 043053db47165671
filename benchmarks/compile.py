"""Time per step of GPipeStrategy(compile=...) against the same run uncompiled, on AmoebaNet and the translation model.

For each model and schedule, two configurations run interleaved as fresh 2-process fits (benchmarks/_compile_run.py):
``eager`` (``compile=False``) and ``compiled`` (``compile=True``: each stage's backbone layers through
``torch.compile`` with its defaults). The figure is rank 0's median steady-state step after the warm-up steps; the
warm-up (where compiling happens: the first step, and later steps that meet new shapes) is reported apart, as the
median over the repeats of the warm-up steps' total time and of the first step's. Repeats after the first find
inductor's on-disk cache (``/tmp/torchinductor_$USER``) filled by the earlier ones, as a second run of a job would;
the first repeat's warm-up is printed too. Models:

  amoebanet     AmoebaNet-D (6, 16), one repeated batch of random 32 x 32 images (fixed shapes)
  translation   the translation example's Transformer (d_model 256, 3 + 3 layers, examples/translation/configs/cpu.yaml)
                on the shipped Multi30k subset in token-bucketed batches: every batch has its own shape

Schedules: ``gpipe`` (fill-drain, ``checkpoint="except_last"``: the recompute runs compiled too) and ``zb-h1``
(zero-bubble: the stage after the first splits each backward into B and W; a compiled layer's backward is one node
that runs in both, see lightning_gpipe/compilation.py).

Usage::

    python benchmarks/compile.py                               # both models, gpipe and zb-h1, 3 repeats
    python benchmarks/compile.py --models amoebanet --schedules gpipe --repeats 2
"""

import argparse
import os
import statistics
from dataclasses import dataclass, field

import _harness as harness

from lightning_gpipe.engine.schedule import SCHEDULES

COMPILE_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compile_run.py")
"""The script that makes one measurement."""


@dataclass
class Warmup:
    """The warm-up of one configuration's repeats on rank 0: all warm-up steps, the first step, Dynamo's frames
    compiled in all and during the measured steps."""

    total: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)
    measured_frames: list[int] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = ("amoebanet", "translation")
    parser.add_argument("--models", nargs="+", choices=models, default=list(models))
    parser.add_argument("--schedules", nargs="+", choices=tuple(SCHEDULES), default=["gpipe", "zb-h1"])
    parser.add_argument("--chunks", type=int, default=4, help="M (default 4)")
    parser.add_argument("--batch-size", type=int, default=64, help="amoebanet images per batch (default 64)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="translation tokens per side (default 2048)")
    parser.add_argument("--compile", default="true", help="the compiled runs' compile=, as JSON (default true)")
    harness.add_timing_args(parser, repeats=3, steps=6, warmup=3)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("chunks", "batch_size", "max_tokens", "repeats", "steps", "warmup"))
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """``MODEL/SCHEDULE/eager`` and ``MODEL/SCHEDULE/compiled`` for every model and schedule."""
    result = []
    for model in args.models:
        for schedule in args.schedules:
            checkpoint = "except_last" if schedule == "gpipe" else "never"
            common = [model, "--schedule", schedule, "--checkpoint", checkpoint, "--chunks", str(args.chunks)]
            common += ["--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens)]
            common += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            for label, value in (("eager", "false"), ("compiled", args.compile)):
                result.append(
                    harness.Config(
                        f"{model}/{schedule}/{label}",
                        [*common, "--compile", value],
                        describe=f"{model}, GPipeStrategy(schedule={schedule!r}, checkpoint={checkpoint!r},"
                        f" chunks={args.chunks}, compile={value}), 2 processes x 1 thread",
                    )
                )
    return result


def interleave(grid: list[harness.Config], repeats: int, settle_s: float) -> tuple[dict, dict]:
    """Run the configurations interleaved, printing each run; the step-time series and the warm-ups, by name."""
    results = {config.name: harness.Series() for config in grid}
    warmups = {config.name: Warmup() for config in grid}
    for repeat in range(repeats):
        for config in grid:
            found, ticks = harness.settle(settle_s), harness.cpu_ticks()
            records = harness.run_or_exit(config).records
            stolen = harness.stolen_share(ticks, harness.cpu_ticks())
            main, series, warmup = records[0], results[config.name], warmups[config.name]
            series.medians.append(main["median_s"])
            series.busiest_cpu.append(max(r["cpu_s"] for r in records))
            series.contended.append(max(max(r["runq_wait"] for r in records), stolen) > harness.CONTENDED)
            warmup.total.append(main["warmup_s"])
            warmup.first.append(main["first_s"])
            warmup.frames.append(sum(r["frames_compiled"] for r in records))
            warmup.measured_frames.append(sum(r["frames_measured"] for r in records))
            wait = "/".join(f"{100 * r['runq_wait']:.0f}%" for r in records)
            print(
                f"repeat {repeat + 1}  {config.name:<28} {main['median_s']:.4f} s/step (range {min(main['step_s']):.4f}"
                f"-{max(main['step_s']):.4f}); warm-up {main['warmup_s']:.1f} s, first step {main['first_s']:.1f} s;"
                f" frames compiled {warmup.frames[-1]} ({warmup.measured_frames[-1]} while measured); waited for a"
                f" CPU {wait}; stolen {100 * stolen:.0f}%{found}{'  [contended]' if series.contended[-1] else ''}",
                flush=True,
            )
    return results, warmups


def summarise(args: argparse.Namespace, results: dict, warmups: dict) -> None:
    """Per model and schedule: compiled over eager step time (< 1: compiled is faster), and the warm-ups."""
    for model in args.models:
        for schedule in args.schedules:
            eager, compiled = f"{model}/{schedule}/eager", f"{model}/{schedule}/compiled"
            print(f"{model}, {schedule}:")
            harness.print_ratio("  step time", results[compiled], results[eager], "compiled", "eager")
            for name in (eager, compiled):
                w = warmups[name]
                total, first = statistics.median(w.total), statistics.median(w.first)
                print(
                    f"    {name:<28} warm-up {total:.1f} s (first repeat {w.total[0]:.1f} s), first step {first:.1f} s"
                    f" (first repeat {w.first[0]:.1f} s)"
                )
    if "zb-h1" in args.schedules and "gpipe" in args.schedules:
        print("zero-bubble over fill-drain (< 1: ZB-H1 is faster):")
        for model in args.models:
            for label in ("eager", "compiled"):
                harness.print_ratio(
                    f"  {model}/{label}",
                    results[f"{model}/zb-h1/{label}"],
                    results[f"{model}/gpipe/{label}"],
                    "zb-h1",
                    "gpipe",
                )


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the ratios."""
    args = parse_args(argv)
    harness.RUNS = COMPILE_RUN  # harness.run starts this script instead of benchmarks/_runs.py
    grid = configs(args)
    settings = (
        f"M={args.chunks}, K=2; amoebanet batch {args.batch_size}, translation max_tokens {args.max_tokens};"
        f" {args.warmup} warm-up + {args.steps} measured steps per run; {args.repeats} interleaved repeats"
    )
    harness.print_header(settings, grid, "median time per optimizer step (s) on global rank 0, after the warm-up")

    def body() -> None:
        results, warmups = interleave(grid, args.repeats, args.settle)
        harness.print_table(results)
        summarise(args, results, warmups)

    harness.timed(body)


if __name__ == "__main__":
    main()
