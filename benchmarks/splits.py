"""Every 2-stage split of AmoebaNet-D and of the translation model against the split ``balance="time"`` ends with
(issue 60), and the profile's predicted stage times against the measured ones.

For each model, K=2, one configuration per split ``a,b`` (``a + b`` the backbone's layers; ``GPipeStrategy(balance=
[a, b])``) and one with ``balance="time"`` (``time``): the strategy profiles each backbone layer, splits by the
profile, then after its re-split's 3 warm-up and 3 measured optimizer steps (``Resplit``, lightning_gpipe/lightning/
resplit.py) checks the split against the stages' measured busy times and moves layers in place where the simulator
predicts a split at least 5% faster. Each is a fresh 2-process ``Trainer.fit`` (``benchmarks/_runs.py lightning
--breakdown``, one thread per process), run interleaved; the ``time`` configuration gets 6 more warm-up steps than
the others (the check's), so that every configuration measures steady steps of the split it ends with. Models:

  amoebanet    AmoebaNet-D (3, 16), as examples/amoebanet/configs/cifar10_20min.yaml: 7 backbone layers (6 splits),
               batch 128 of random 32 x 32 images, M=4, channels_last, checkpoint never, zb-h1, bf16-mixed
               (``--amoebanet-precision 32-true``: as the recipe trains where bf16 is emulated)
  translation  the translation example's Transformer (examples/translation/configs/cpu.yaml's model: d_model 256,
               3 + 3 layers: 9 backbone layers, 8 splits) on its first batch of 4,096 tokens per side, M=4,
               checkpoint never, the strategy's default schedule, fp32

Printed per model, after the header (the CPU named from /proc/cpuinfo) and the per-repeat table: each split's median
s/step, its ratio to the fastest split's, and its stages' measured busy ms per step (forward, recompute, backward and
weight-gradient spans: what the re-split's check measures) beside the profile's prediction of them (from the ``time``
runs' profiled ``LayerCost`` s, the median over repeats: M times each stage's layers' forward (times 1 + the
recomputed share) and backward, B and W apart on the stages after the first where the run splits its backwards, as
``resplit.profiled_busy`` predicts them); the ``time`` runs' profiled split, the check's record (its own profile's
prediction and error) and the split each run ended with; then two verdicts:

- ``split``: PASS where, in every repeat, the split ``balance="time"`` ended with has a median step within 5% of the
  fastest split's (both from the fixed-split configurations; the ``time`` runs' own median is printed beside);
- ``profile``: PASS where the profile's predicted busy time of each stage of the split the ``time`` runs ended with
  is within 15% of the stage's busy time measured in their steady steps (medians over the repeats).

Usage::

    python benchmarks/splits.py --settle 30                 # both models, 3 interleaved repeats (the issue's figures)
    python benchmarks/splits.py --models amoebanet --repeats 5
    python benchmarks/splits.py --models amoebanet --amoebanet-precision 32-true   # an AVX2-only CPU's recipe
    python benchmarks/splits.py --quick                     # a smoke run: tiny batches, 1 repeat, 2 steps
"""

import argparse
import os
import platform
import statistics
from dataclasses import dataclass

import _harness as harness

from lightning_gpipe.lightning.resplit import Resplit, profiled_busy
from lightning_gpipe.planning import LayerCost

CHUNKS, CHECKPOINT = 4, "never"
"""M and the checkpoint mode of every run (the recipes')."""

CHECK_STEPS = Resplit().warmup + Resplit().steps
"""Optimizer steps before the re-split's check: ``Resplit``'s default warm-up (3) and measured ones (3)."""

SPLIT_TOLERANCE, PROFILE_TOLERANCE = 0.05, 0.15
"""The issue's bounds: the ended split's step over the fastest's, and the profile's error per stage."""

BUSY = ("forward", "recompute", "backward", "weight")
"""The breakdown's span kinds a stage's busy time sums (as ``resplit.work_seconds``)."""


@dataclass(frozen=True)
class Model:
    """One model's runs: its backbone's layer count, the arguments of ``_runs.py`` (the model's, its batch's size and
    its ``--quick`` batch's) and a line saying what runs."""

    layers: int
    args: tuple[str, ...]
    size: tuple[str, ...]
    quick: tuple[str, ...]
    describe: str


MODELS = {
    "amoebanet": Model(
        7,
        ("--model", "amoebanet", "--amoebanet-layers", "3", "--channels-last", "--schedule", "zb-h1"),
        ("--batch-size", "128"),
        ("--batch-size", "8"),
        "AmoebaNet-D (3, 16), channels_last, M=4, checkpoint never, zb-h1",
    ),
    "translation": Model(
        9,
        ("--model", "translation"),
        ("--max-tokens", "4096"),
        ("--max-tokens", "256"),
        "translation Transformer (d_model 256, 3 + 3 layers), M=4, checkpoint never, default schedule, fp32",
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: tiny batches, 1 repeat, 1 warm-up and 2 measured steps"
    )
    parser.add_argument(
        "--amoebanet-precision",
        choices=("bf16-mixed", "32-true"),
        default="bf16-mixed",
        help="AmoebaNet-D's precision: the recipe's bf16-mixed, or 32-true, which the recipe's precision_fallback "
        "trains in on a CPU without native bf16 (default bf16-mixed)",
    )
    harness.add_timing_args(parser, repeats=3, steps=8, warmup=2)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 2, 1
    harness.check_positive(parser, args, ("repeats", "steps", "warmup"))
    return args


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """``MODEL/a,b`` for every 2-stage split of each model, and ``MODEL/time``."""
    result = []
    for name in args.models:
        model = MODELS[name]
        common = ["lightning", "--devices", "2", "--chunks", str(CHUNKS), "--checkpoint", CHECKPOINT, "--breakdown"]
        common += ["--steps", str(args.steps)]
        common += [*model.args, *(model.quick if args.quick else model.size), *precision(name, args)]
        described = ", ".join([model.describe, *precision(name, args)[1:]])
        for first in range(1, model.layers):
            split = f"{first},{model.layers - first}"
            run = [*common, "--balance", split, "--warmup", str(args.warmup)]
            result.append(harness.Config(f"{name}/{split}", run, describe=f"{described}; balance=[{split}]"))
        run = [*common, "--balance", "time", "--warmup", str(args.warmup + CHECK_STEPS)]
        describe = f"{described}; balance='time' (re-split checked after {CHECK_STEPS} steps)"
        result.append(harness.Config(f"{name}/time", run, describe=describe))
    return result


def precision(name: str, args: argparse.Namespace) -> list[str]:
    """The ``_runs.py`` precision arguments of model ``name``: AmoebaNet-D's ``--amoebanet-precision``; the
    translation model trains in fp32."""
    return ["--precision", args.amoebanet_precision] if name == "amoebanet" else []


def busy_ms(records: list[dict]) -> list[float]:
    """Each stage's busy ms per measured step in one run (its breakdown's forward, recompute, backward, weight)."""
    return [sum(r["breakdown"].get(kind, 0.0) for kind in BUSY) for r in sorted(records, key=lambda r: r["stage"])]


def predicted_ms(
    costs: list[dict], split: list[int], micro_batches: int, checkpoint: str, split_backward: bool
) -> list[float]:
    """The profile's busy ms per step of each stage of ``split`` (``resplit.profiled_busy``: ``micro_batches`` times its
    layers' forward, with the recomputed share under ``checkpoint``, and backward, B and W on the stages after the first
    where ``split_backward``), as the re-split's check predicts them."""
    layers = [LayerCost(**cost) for cost in costs]
    return [1e3 * s for s in profiled_busy(layers, split, micro_batches, checkpoint, split_backward)]


def split_backward(runs: list[list[dict]]) -> bool:
    """Whether the ``time`` runs split their backwards into B and W (their check's record; the first run's)."""
    record = runs[0][0].get("resplit") or {}
    return bool(record.get("split_backward", False))


def median_costs(runs: list[list[dict]]) -> list[dict]:
    """The per-layer median, field by field, of the profiled costs rank 0 of each ``time`` run reported."""
    profiles = [records[0]["layer_costs"] for records in runs]
    return [{k: statistics.median(p[i][k] for p in profiles) for k in profiles[0][i]} for i in range(len(profiles[0]))]


def ended(records: list[dict]) -> list[int] | None:
    """The split a ``time`` run ended with: the re-split's, else the one it checked (``None``: no check ran)."""
    record = records[0].get("resplit")
    return None if record is None else record["resplit"] or record["balance"]


def _stage_cells(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)


def summarise(name: str, results: dict[str, harness.Series]) -> None:
    """One model's table and its two verdicts."""
    time_runs = results[f"{name}/time"].records
    costs, halves = median_costs(time_runs), split_backward(time_runs)
    fixed = [key for key in results if key.startswith(f"{name}/") and key != f"{name}/time"]
    splits = {key: [int(n) for n in key.split("/")[1].split(",")] for key in fixed}
    fastest = min(splits, key=lambda key: results[key].median())
    best = results[fastest].median()
    print(f"\n{name}: {MODELS[name].describe}")
    print(
        f"{'split':<8}{'s/step':>9}{'vs fastest':>12}   {'busy ms/step':>16}   {'profile ms/step':>16}   measured/pred"
    )
    for key, split in splits.items():
        measured = [statistics.median(v) for v in zip(*(busy_ms(r) for r in results[key].records))]
        predicted = predicted_ms(costs, split, CHUNKS, CHECKPOINT, halves)
        ratios = "/".join(f"{a / b:.2f}" for a, b in zip(measured, predicted))
        step = results[key].median()
        print(
            f"{','.join(map(str, split)):<8}{step:>9.4f}{step / best:>11.2f}x   {_stage_cells(measured):>16}   "
            f"{_stage_cells(predicted):>16}   {ratios}"
        )
    step = results[f"{name}/time"].median()
    print(f"{'time':<8}{step:>9.4f}{step / best:>11.2f}x   (its steady steps, at the split it ended with)")
    _verdicts(name, results, time_runs, costs, fastest, halves)


def _verdicts(name, results, time_runs, costs, fastest, halves) -> None:
    """The time runs' record per repeat, and the PASS/FAIL lines of the split and of the profile."""
    best, ends = results[fastest].median(), []
    for repeat, records in enumerate(time_runs, 1):
        split = ended(records)
        ends.append(split)
        found = _check_line(records[0].get("resplit"))
        print(f"  time run {repeat}: {found}; ended with {split}")
    ratios = [results[f"{name}/{split[0]},{split[1]}"].median() / best if split else float("inf") for split in ends]
    verdict = "PASS" if max(ratios) <= 1 + SPLIT_TOLERANCE else "FAIL"
    print(
        f"{verdict} split ({name}): balance='time' ended with {ends}, median step"
        f" {', '.join(f'{r:.3f}x' for r in ratios)} the fastest split's ({fastest.split('/')[1]}); bound"
        f" {1 + SPLIT_TOLERANCE:.2f}x"
    )
    final = ends[-1]
    if final is None or any(split != final for split in ends):
        print(f"FAIL profile ({name}): the time runs did not all end with one split: {ends}")
        return
    measured = [statistics.median(v) for v in zip(*(busy_ms(r) for r in time_runs))]
    predicted = predicted_ms(costs, final, CHUNKS, CHECKPOINT, halves)
    errors = [abs(p - m) / m for p, m in zip(predicted, measured)]
    verdict = "PASS" if max(errors) <= PROFILE_TOLERANCE else "FAIL"
    print(
        f"{verdict} profile ({name}): at {final}, predicted {_stage_cells(predicted)} ms against measured"
        f" {_stage_cells(measured)} ms busy per step (stage 0/1): errors"
        f" {', '.join(f'{100 * e:.1f}%' for e in errors)} of the measured; bound {100 * PROFILE_TOLERANCE:.0f}%"
    )


def _check_line(record: dict | None) -> str:
    """What a ``time`` run's check of its split found, in words (its own profile's prediction and error)."""
    if record is None:
        return "no check of the split ran"
    measured, balance = [1e3 * s for s in record["measured_s"]], record["balance"]
    line = f"profiled split {balance}, checked: busy {_stage_cells(measured)} ms per step"
    if "refused" in record:
        return f"{line}; kept whatever the times: {record['refused']}"
    errors = ", ".join(f"{100 * e:+.0f}%" for e in record["profile_error"])
    line += f" against the profile's {_stage_cells([1e3 * s for s in record['profiled_s']])} (error {errors})"
    return (
        f"{line}; best split of the measured costs {record['best_balance']}, predicted step"
        f" {1e3 * record['best_step_s']:.0f} ms against {1e3 * record['predicted_step_s']:.0f} ms:"
        f" {'re-split' if record['resplit'] else 'kept'}"
    )


def cpu_name() -> str:
    """The CPU's model name and its bf16 units, from /proc/cpuinfo (``platform.processor()`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    units = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    return f"{fields.get('model name', 'unknown CPU')} ({os.cpu_count()} CPUs; {', '.join(units) or 'no AVX2'})"


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements, then each model's table and verdicts."""
    args = parse_args(argv)
    grid = configs(args)
    settings = (
        f"K=2, {args.warmup} warm-up (+{CHECK_STEPS} for balance='time') + {args.steps} measured steps per run;"
        f" {args.repeats} interleaved repeats{'; --quick: tiny batches' if args.quick else ''}; CPU: {cpu_name()}"
    )
    harness.print_header(settings, grid, "median time per optimizer step (s) on global rank 0")

    def body() -> None:
        results = harness.interleave(grid, args.repeats, args.settle)
        harness.print_table(results)
        for name in args.models:
            summarise(name, results)

    harness.timed(body)


if __name__ == "__main__":
    main()
