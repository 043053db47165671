"""Does the planner's memory prediction hold? Each stage's peak of live tensors against the prediction, over a grid.

Every plan of the grid (``chunks`` x ``checkpoint`` x ``schedule``, one model chunk per stage, a fixed balance) is one
``Trainer.fit`` of two steps on ``--devices`` processes under ``GPipeStrategy(plan="auto")`` with those fixed (the
planner profiles at the plan's micro-batch size, as when ``chunks`` is given, and predicts), under a memory limit no
plan reaches. Every process counts its live tensors during training (``_runs.LiveBytes``: parameters, gradients,
optimizer state, activations, batches, transfer buffers; what ``memory_limit`` covers, as
``torch.cuda.max_memory_allocated`` reads it on a GPU) and reports their peak. Byte counts do not depend on the
machine's load: each plan runs once.

The models: the translation example's Transformer (``examples/translation``: d_model 256, 3 + 3 layers, an
8,000-word vocabulary, AdamW) on the first batch of its shipped Multi30k subset (113 sentence pairs, at most 4,096
padded tokens per side), repeated; its loss, on logits of 113 x 36 x 8,000, is as large as a stage's activations.
And AmoebaNet-D (6, 16) (``examples/amoebanet``, SGD with momentum) on a batch of random 32 x 32 images.

One line per plan; per model and stage the measured peak (MiB) / the predicted one, their ratio, and on the last
stage in brackets the ratio to the prediction without what runs after the backbone (head and loss), as the planner
predicted before it measured them. Then per model the ranges of three ratios measured / predicted:

- ``predicted``: from the run's profile (at the plan's micro-batch size);
- ``planner``: from the profile the planner takes when it chooses ``chunks`` itself (the layers at 1/8 and 1/64 of
  the batch, their bytes scaled to the plan's micro-batch size): the error of that extrapolation;
- ``no loss``: from the run's profile without the head and loss.

Every prediction is made by this checkout's planner from the saved profiles, so ``--load`` prints a saved grid again
as the current planner predicts it.

Usage::

    python benchmarks/plan_memory.py                                  # both models, 16 plans each
    python benchmarks/plan_memory.py --model translation --chunks 2 --checkpoint never --schedule gpipe
    python benchmarks/plan_memory.py --save grid.json; python benchmarks/plan_memory.py --load grid.json
"""

import argparse
import dataclasses
import json
import sys
from itertools import product
from pathlib import Path

import _harness as harness
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: lightning_gpipe, benchmarks

from benchmarks import models  # noqa: E402
from lightning_gpipe import plan  # noqa: E402
from lightning_gpipe.planning import CostModel, PipelinePlan, ProfiledCosts, predict  # noqa: E402
from lightning_gpipe.planning.balance import LayerCost  # noqa: E402
from lightning_gpipe.planning.costs import HeadCost  # noqa: E402

MIB = 2**20
MODELS = {"translation": [6, 3], "amoebanet": [4, 6]}
"""The models and the balance each runs with (the planner's split by time at 8 micro-batches here)."""
HUGE_MIB = 2**20
"""The memory limit of every run (1 TiB): no plan is refused."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", nargs="+", choices=tuple(MODELS), default=list(MODELS))
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 8], help="values of M (default 1 2 8)")
    modes = ("never", "except_last", "always")
    parser.add_argument("--checkpoint", nargs="+", choices=modes, default=list(modes), help="modes (default all)")
    parser.add_argument("--schedule", nargs="+", choices=("gpipe", "1f1b"), default=["gpipe", "1f1b"])
    parser.add_argument("--batch-size", type=int, default=64, help="amoebanet: images per batch (default 64)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="translation: tokens per side (default 4096)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run counts as failed")
    parser.add_argument("--save", type=Path, help="write the runs (profiles, plans, measured peaks) to this JSON file")
    parser.add_argument("--load", type=Path, help="run nothing: print the runs a --save wrote, predicted anew")
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("chunks", "batch_size", "max_tokens"))
    return args


def grid(args: argparse.Namespace, model: str) -> list[harness.Config]:
    """One configuration per ``(chunks, checkpoint, schedule)`` (``except_last`` at M = 1 is ``never``)."""
    common = ["lightning", "--model", model, "--devices", "2", "--plan-limit-mib", str(HUGE_MIB), "--steps", "1"]
    common += ["--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens), "--warmup", "1"]
    common += ["--count-live", "--default-allocator", "--virtual-stages", "1"]
    common += ["--plan-fix", "chunks", "checkpoint", "schedule", "virtual_stages"]
    common += ["--plan-balance", *map(str, MODELS[model])]
    found = []
    for m, mode, schedule in product(args.chunks, args.checkpoint, args.schedule):
        if m == 1 and mode == "except_last":
            continue
        fixed = ["--chunks", str(m), "--checkpoint", mode, "--schedule", schedule]
        found.append(harness.Config(f"M{m}/{mode}/{schedule}", [*common, *fixed]))
    return found


def free_profile(args: argparse.Namespace, model: str) -> dict:
    """The profile ``lightning_gpipe.plan`` takes of ``model`` when it chooses ``chunks`` itself, as plain data."""
    torch.manual_seed(0)
    if model == "translation":
        module, batch = models.translation_module(), models.translation_batch(args.max_tokens)
    else:
        module, batch = models.amoebanet_classifier(), models.image_batch(args.batch_size)
    fixed = {"pipeline_parallel_size": 2, "data_parallel_size": 1, "virtual_stages": 1, "balance": MODELS[model]}
    return dataclasses.asdict(plan(module, 2, HUGE_MIB * MIB, example_batch=batch, **fixed).profiled)


def measure(args: argparse.Namespace, config: harness.Config) -> dict:
    """One fit: the plan, its profile, the optimizer's state factor and every stage's measured peak (bytes), or why
    it failed."""
    outcome = harness.run(config, timeout=args.timeout)
    if not outcome.ok or len(outcome.records) != 2:
        lines = outcome.log.strip().splitlines()
        return {"name": config.name, "failed": lines[-1][:160] if lines else "no output"}
    record = outcome.records[0]
    measured = [r["live_peak_mib"] * MIB for r in outcome.records]
    keys = ("profiled", "plan", "state_factor")
    return {"name": config.name, **{key: record[key] for key in keys}, "measured": measured}


def profiled_costs(data: dict) -> ProfiledCosts:
    """The :class:`ProfiledCosts` of a record's ``dataclasses.asdict``."""
    large, small = ([LayerCost(**c) for c in data[key]] for key in ("large", "small"))
    head = data.get("head")
    head = HeadCost(tuple(head["rows"]), tuple(head["peak_bytes"]), head["parameter_bytes"]) if head else None
    return ProfiledCosts(tuple(data["rows"]), large, small, data["batch_rows"], data["input_bytes"], head)


def pipeline_plan(chosen: dict) -> PipelinePlan:
    """The :class:`PipelinePlan` of a run's record (the report's chosen plan as a dict)."""
    keys = ("pipeline_parallel_size", "data_parallel_size", "chunks", "checkpoint", "schedule")
    return PipelinePlan(*(chosen[key] for key in keys), tuple(chosen["balance"]), chosen.get("virtual_stages", 1))


def figures(run: dict, free: ProfiledCosts) -> list[tuple]:
    """Per stage of a run: ``(measured, predicted, planner, no loss, loss)`` in bytes (see the module docstring)."""
    chosen, factor, own = pipeline_plan(run["plan"]), run["state_factor"], profiled_costs(run["profiled"])
    profiles = (own, free, dataclasses.replace(own, head=None))
    predicted, planner, bare = (predict(chosen, p, CostModel(), factor, float("inf")).memory for p in profiles)
    return [
        (measured, p.total, f.total, b.total, max(p.transient, p.loss) - p.transient)
        for measured, p, f, b in zip(run["measured"], predicted, planner, bare)
    ]


def _cells(run: dict, free: ProfiledCosts) -> str:
    """A run's cells: per stage measured/predicted MiB and their ratio, on the last without the loss's in brackets."""
    if "failed" in run:
        return f"{'failed: ' + run['failed'][:40]:<42}"
    stages = figures(run, free)
    cells = [f"{m / MIB:>5.0f}/{p / MIB:<5.0f}{m / p:.2f}" for m, p, _, _, _ in stages]
    return "  ".join(cells) + f" ({stages[-1][0] / stages[-1][3]:.2f})"


def report(grids: dict[str, tuple[list[dict], ProfiledCosts]]) -> None:
    """The table of every model's runs, side by side by plan, and the range of each ratio per model."""
    print("\npeak MiB of live tensors, measured/predicted and ratio, per stage; in brackets the last stage's ratio")
    print("to the prediction without the head and loss")
    print((f"{'plan':<20}" + "".join(f"{f'{model} {MODELS[model]}: stages 0, 1':<42}" for model in grids)).rstrip())
    names = list(dict.fromkeys(run["name"] for runs, _ in grids.values() for run in runs))
    found = {model: {run["name"]: run for run in runs} for model, (runs, _) in grids.items()}
    for name in names:
        cells = [_cells(found[model][name], free) if name in found[model] else "" for model, (_, free) in grids.items()]
        print(f"{name:<20}" + "".join(f"{cell:<42}" for cell in cells).rstrip())
    for model, (runs, free) in grids.items():
        stages = [stage for run in runs if "failed" not in run for stage in figures(run, free)]
        ranges = [[stage[0] / stage[i] for stage in stages] for i in (1, 2, 3)]
        if stages:
            low_high = [f"{min(ratios):.2f}-{max(ratios):.2f}" for ratios in ranges]
            print(
                f"{model}, {len(stages)} stages, measured / predicted: {low_high[0]}; from the planner's profile"
                f" {low_high[1]}; without the loss {low_high[2]}"
            )


def main(argv: list[str] | None = None) -> None:
    """Measure every plan of every model's grid (or load them); print each model's table."""
    args = parse_args(argv)
    if args.load is not None:
        saved = json.loads(args.load.read_text())
        report({model: (data["runs"], profiled_costs(data["free"])) for model, data in saved["models"].items()})
        return
    harness.print_command(
        f"K=2, one model chunk per stage, 2 steps per fit; translation: the example's Transformer, its first batch at"
        f" {args.max_tokens} tokens per side; amoebanet: AmoebaNet-D (6, 16), {args.batch_size} images"
    )
    saved: dict = {"command": sys.argv, "models": {}}

    def body() -> None:
        for model in args.model:
            free = free_profile(args, model)
            runs = []
            for config in grid(args, model):
                runs.append(measure(args, config))
                print(f"{config.name}: {runs[-1].get('failed') or 'measured'}", flush=True)
            saved["models"][model] = {"free": free, "runs": runs}
        report({model: (data["runs"], profiled_costs(data["free"])) for model, data in saved["models"].items()})
        if args.save is not None:
            args.save.write_text(json.dumps(saved))

    harness.timed(body)


if __name__ == "__main__":
    main()
