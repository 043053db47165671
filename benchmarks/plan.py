"""Does ``GPipeStrategy(plan="auto")`` choose well, and are its predictions right? (issue 23)

One run of ``GPipeStrategy(plan="auto", memory_limit=L)`` against a grid of plans, each the planner fixed to one
``(chunks, checkpoint, schedule, virtual_stages)`` (``plan="auto"`` with those four given: the planner still chooses the
balance and predicts the plan, and refuses it before step 1 if it does not fit L). Every run trains on ``--devices``
processes, each under ``RLIMIT_DATA`` = L + ``--reserve-mib`` (the process's own memory: Python, torch, Lightning, gloo;
see benchmarks/capacity.py for the cap). The configurations run interleaved (auto, grid..., auto, grid...), and the
table gives per plan: the median measured step time on rank 0 against the planner's prediction, and each process's
measured peaks against the predicted peak of its stage: of its live tensors during training (what ``memory_limit``
covers, as ``torch.cuda.max_memory_allocated`` reads it on a GPU; ``_runs.LiveBytes``), and of its resident set
during training over its resident set before setup (the process's own memory too: the allocator's, the
libraries'). Time and memory come from separate runs: time from runs with glibc's allocator as a user has it, every
repeat; memory from one run per plan (in the first repeat) that gives every allocation of 64 KiB or more a mapping of
its own, so that the resident set follows the live memory, not the allocator's cache (benchmarks/_runs.py). Such a
mapping faults its pages in anew at every allocation, which slowed AmoebaNet's layers 1.6-2.2x here: a time measured
so, and the profile the planner takes in that process, are not a user's.

Usage::

    python benchmarks/plan.py                                   # the activation-heavy MLP, L = 80 MiB
    python benchmarks/plan.py --model amoebanet --batch-size 64 --chunks 4 8 16 32
    python benchmarks/plan.py --chunks 2 4 --checkpoint never always --schedule gpipe   # a smaller grid
    python benchmarks/plan.py --chunks 8 --checkpoint never --schedule gpipe 1f1b zb-h1 --virtual-stages 1 2
    python benchmarks/plan.py --chunks 8 --checkpoint never --schedule 1f1b zb-1p v-min --repeats 1   # issue 59

The planner considers every schedule (those that split their backwards too: it profiles B and W), so ``auto`` may run
one of the grid's zero-bubble or V schedules; a V schedule (``v-min``, ``v-half``, ``v-zb``, ``zb-v``) is a grid
plan with its two model chunks per stage whatever ``--virtual-stages`` says.

**The mesh, the sharding and offload** (issue 59): ``--meshes 2x1 1x2`` puts each pipeline x data-parallel size (K x D,
K x D = ``--devices``) in the grid, each D > 1 mesh with every ``--sharding`` (FSDP2's ``SHARD_GRAD_OP`` or
``FULL_SHARD``, or the state whole: ``NO_SHARD``), and ``--offload none activations`` each plan that re-materializes
nothing with and without ``offload="activations"`` (on a CPU the mechanism runs and moves nothing: its bookkeeping's
cost). The strategy plans within the mesh it was launched with, so with several meshes ``auto`` is launched on the
mesh ``lightning_gpipe.plan`` chooses for the same model, batch and limit over every mesh of ``--devices`` processes
(profiled in this process, one thread, as a user plans before launching), then plans the rest itself. A mesh of D
replicas trains D batches per step, so plans are compared by their seconds per trained batch (the step over D)::

    python benchmarks/plan.py --chunks 8 16 --checkpoint never except_last --schedule gpipe 1f1b \
        --meshes 2x1 1x2 --sharding NO_SHARD SHARD_GRAD_OP --offload none activations --repeats 1
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from itertools import combinations, product
from pathlib import Path

import _harness as harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's lightning_gpipe

from lightning_gpipe.engine.schedule import DEFERRED_BY_DEFAULT, SCHEDULES, V_SHAPED
from lightning_gpipe.planning import CostModel, PipelinePlan, ProfiledCosts, predict
from lightning_gpipe.planning.balance import LayerCost

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("mlp", "amoebanet"), default="mlp")
    parser.add_argument("--limit-mib", type=float, default=80.0, help="memory_limit per process, MiB (default 80)")
    parser.add_argument("--reserve-mib", type=int, default=800, help="RLIMIT_DATA above the limit (default 800)")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32])
    modes = ("never", "except_last", "always")
    parser.add_argument("--checkpoint", nargs="+", choices=modes, default=list(modes))
    parser.add_argument("--schedule", nargs="+", choices=tuple(SCHEDULES), default=["gpipe", "1f1b"])
    parser.add_argument("--virtual-stages", type=int, nargs="+", default=[1], help="model chunks per stage (default 1)")
    parser.add_argument(
        "--meshes",
        nargs="+",
        help="pipeline x data-parallel sizes of the grid, each KxD with K x D = --devices (default: one pipeline of"
        " --devices stages); with several, auto runs on the mesh lightning_gpipe.plan chooses",
    )
    shardings = ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")
    parser.add_argument(
        "--sharding", nargs="+", choices=shardings, default=["NO_SHARD"], help="a D > 1 mesh's (default NO_SHARD)"
    )
    parser.add_argument(
        "--offload",
        nargs="+",
        choices=("none", "activations"),
        default=["none"],
        help="each plan that re-materializes nothing without (none) and with offload='activations' (default none)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before a run counts as failed")
    parser.add_argument(
        "--save", type=Path, help="write every run (its profile, plan, prediction and measurements) to this JSON file"
    )
    parser.add_argument(
        "--load", type=Path, help="run nothing: print the table and figures of the runs a --save wrote to this file"
    )
    harness.add_timing_args(parser, repeats=2, steps=3, warmup=1)
    args = parser.parse_args(argv)
    positive = ("devices", "batch_size", "width", "depth", "chunks", "virtual_stages", "repeats", "steps")
    harness.check_positive(parser, args, positive)
    args.meshes = [_mesh(parser, text, args.devices) for text in args.meshes or [f"{args.devices}x1"]]
    return args


def _mesh(parser: argparse.ArgumentParser, text: str, devices: int) -> tuple[int, int]:
    """``KxD`` as ``(K, D)``, refused unless K x D is the number of processes."""
    try:
        k, d = (int(n) for n in text.lower().split("x"))
    except ValueError:
        parser.error(f"--meshes takes KxD (e.g. 2x1), got {text!r}")
    if k < 1 or d < 1 or k * d != devices:
        parser.error(f"--meshes {text}: K x D must be --devices ({devices})")
    return k, d


def configs(args: argparse.Namespace) -> list[harness.Config]:
    """``auto``, then one configuration per ``(mesh, chunks, checkpoint, schedule, virtual_stages, sharding,
    offload)`` of the grid (a schedule that needs two stages or more only where K is; sharding only where D > 1;
    offload only where nothing is re-materialized)."""
    common = ["lightning", "--model", args.model, "--momentum", str(args.momentum), "--plan-limit-mib"]
    common += [str(args.limit_mib), *harness.mlp_run_args(args)]
    several, named = len(args.meshes) > 1, args.meshes != [(args.devices, 1)]  # named: not the default mesh alone
    mesh = planned_mesh(args) if several else args.meshes[0]
    found = [harness.Config("auto", [*common, *(["--mesh", *map(str, mesh)] if named else [])], describe="plan='auto'")]
    points = product(
        args.meshes, args.chunks, args.checkpoint, args.schedule, args.virtual_stages, args.sharding, args.offload
    )
    for (k, d), m, mode, schedule, v, sharding, offload in dict.fromkeys(
        (mesh, m, c, s, 2 if s in V_SHAPED else v, sh if mesh[1] > 1 else "NO_SHARD", o if c == "never" else "none")
        for mesh, m, c, s, v, sh, o in points
    ):
        if m == 1 and mode == "except_last" or k == 1 and (schedule in V_SHAPED or DEFERRED_BY_DEFAULT[schedule]):
            continue  # the same plan as "never"; a schedule of two stages or more
        fixed = ["--chunks", str(m), "--checkpoint", mode, "--schedule", schedule, "--virtual-stages", str(v)]
        fixed += ["--plan-fix", "chunks", "checkpoint", "schedule", "virtual_stages"]
        fixed += ["--mesh", str(k), str(d)] if named else []
        fixed += ["--sharding-strategy", sharding] if d > 1 else []
        fixed += ["--offload"] if offload == "activations" else []
        name = f"M{m}/{mode}/{schedule}" + (f"/v{v}" if v > 1 else "") + (f"/{k}x{d}" if several else "")
        name += (f"/{sharding}" if d > 1 else "") + ("/offload" if offload == "activations" else "")
        found.append(harness.Config(name, [*common, *fixed]))
    return found


def planned_mesh(args: argparse.Namespace) -> tuple[int, int]:
    """The mesh (K, D) ``lightning_gpipe.plan`` chooses for the run's model, batch and ``--limit-mib`` over every mesh
    of ``--devices`` processes, profiled here with one thread (as each run's process has), printed."""
    import models
    import torch

    from lightning_gpipe import plan

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model == "amoebanet":
        module, batch = models.amoebanet_classifier(6), models.image_batch(args.batch_size)
    else:
        module = models.MLPClassifier(args.width, args.depth, momentum=args.momentum)
        batch = models.mlp_batch(args.batch_size, args.width)
    chosen = plan(module, args.devices, int(args.limit_mib * MIB), example_batch=batch).chosen.plan
    mesh = chosen.pipeline_parallel_size, chosen.data_parallel_size
    print(f"lightning_gpipe.plan chose the mesh {mesh[0]}x{mesh[1]} for auto ({_options(chosen.options())})")
    return mesh


def measure(args: argparse.Namespace, config: harness.Config, memory: bool = False) -> dict:
    """One run under the cap: rank 0's median step, each process's measured peak (MiB), the plan and its
    prediction (each process's: rank r holds stage r mod K); or why it did not train. ``memory``: the run that
    measures the peak (every large allocation mapped on its own, see the module docstring); else glibc's allocator as
    a user has it, for the time."""
    cap = int((args.limit_mib + args.reserve_mib) * MIB)
    run = dataclasses.replace(config, args=[*config.args, *(["--count-live"] if memory else ["--default-allocator"])])
    outcome = harness.run(run, memory_cap=cap, timeout=args.timeout)
    if not outcome.ok or len(outcome.records) != args.devices:
        refused = "No pipeline plan fits" in outcome.log
        return {"failed": "refused: predicted not to fit" if refused else _cause(outcome.log)}
    plan = outcome.records[0]["plan"]
    return {
        "profiled": outcome.records[0]["profiled"],
        "state_factor": outcome.records[0]["state_factor"],
        "median_s": outcome.records[0]["median_s"],
        "measured_mib": [r["model_peak_mib"] for r in outcome.records],
        "live_mib": [r.get("live_peak_mib") for r in outcome.records],
        "predicted_s": plan["step_time"],
        "predicted_mib": [plan["peak_bytes"][r % len(plan["peak_bytes"])] / MIB for r in range(args.devices)],
        "plan": plan,
        "runq": max(r["runq_wait"] for r in outcome.records),
        "memory_run": memory,
    }


def _cause(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if "Error" in line or "memory" in line]
    return (lines[-1] if lines else "no error message (killed or timed out)")[:200]


def main(argv: list[str] | None = None) -> None:
    """Run the configurations interleaved, print each run, then the table and the figures."""
    args = parse_args(argv)
    if args.load is not None:
        saved = json.loads(args.load.read_text())
        summarise(parse_args(saved["command"][1:]), saved["time_runs"], saved["memory_runs"])
        return
    grid = configs(args)
    model = "AmoebaNet-D (6, 16)" if args.model == "amoebanet" else f"{args.depth} x (Linear({args.width}), ReLU)"
    harness.print_command(
        f"{model}, batch {args.batch_size}, SGD momentum {args.momentum}; {args.devices} processes; memory_limit"
        f" {args.limit_mib:g} MiB, RLIMIT_DATA {args.limit_mib + args.reserve_mib:g} MiB per process;"
        f" {len(grid) - 1} grid plans + auto; {args.repeats} interleaved repeats"
    )
    runs: dict[str, list[dict]] = {config.name: [] for config in grid}  # the time runs
    peaks: dict[str, dict] = {}  # the memory run of each plan that trained

    def body() -> None:
        for repeat in range(args.repeats):
            for config in grid:
                if repeat and runs[config.name][0].get("failed", "").startswith("refused"):
                    continue  # refused before step 1: the planner predicts the same every time
                result = measure(args, config)
                runs[config.name].append(result)
                _print(repeat, config.name, result)
                if repeat == 0 and "failed" not in result:
                    peaks[config.name] = measure(args, config, memory=True)
                    _print(repeat, config.name, peaks[config.name])
        if args.save is not None:
            args.save.write_text(json.dumps({"command": sys.argv, "time_runs": runs, "memory_runs": peaks}))
        summarise(args, runs, peaks)

    harness.timed(body)


def _print(repeat: int, name: str, result: dict) -> None:
    print(f"repeat {repeat + 1} {name:<24} {_line(result)}  load {os.getloadavg()[0]:.2f}", flush=True)


def _line(result: dict) -> str:
    if "failed" in result:
        return result["failed"]
    plan = result["plan"]
    chosen = f"{_options(plan)} balance {plan['balance']}"
    if result["memory_run"]:
        resident, live = ("/".join(f"{m:.0f}" for m in result[key]) for key in ("measured_mib", "live_mib"))
        predicted = "/".join(f"{m:.0f}" for m in result["predicted_mib"])
        return f"memory run: peak MiB tensors {live}, resident {resident} (predicted {predicted}); {chosen}"
    return (
        f"{result['median_s']:.3f} s/step (predicted {result['predicted_s']:.3f}); {chosen};"
        f" waited {100 * result['runq']:.0f}%"
    )


def _options(plan: dict) -> str:
    """A plan's options in a few words: M, re-materialization, schedule, model chunks, sharding and offload where
    set."""
    extras = [plan[key] for key in ("sharding_strategy", "offload") if plan.get(key)]
    mesh = f"{plan.get('pipeline_parallel_size', '?')}x{plan.get('data_parallel_size', 1)}"
    words = [mesh, f"M={plan['chunks']}", plan["checkpoint"], plan["schedule"], f"v={plan.get('virtual_stages', 1)}"]
    words += extras
    return " ".join(words)


def summarise(args: argparse.Namespace, runs: dict[str, list[dict]], peaks: dict[str, dict]) -> None:
    """The table (medians over the time runs of the seconds per trained batch, the step over D; the memory run's
    peaks) and the issue's figures."""
    print()
    header = f"{'plan':<24}{'s/batch':>11}{'predicted':>10}{'ratio':>7}"
    print(f"{header}  peak MiB per stage: tensors | resident / predicted")
    rows = {}
    for name, results in runs.items():
        good = [r for r in results if "failed" not in r]
        if not good:
            print(f"{name:<24}  {results[0]['failed']}")
            continue
        median = statistics.median(r["median_s"] / _replicas(r) for r in good)
        step = statistics.median(r["predicted_s"] / _replicas(r) for r in good)
        memory = peaks.get(name, {"failed": "no memory run"})
        if "failed" in memory:
            print(f"{name:<24}{median:>11.3f}{step:>10.3f}{step / median:>7.2f}  memory run: {memory['failed']}")
            continue
        measured = {"tensors": memory["live_mib"], "resident": memory["measured_mib"]}
        rows[name] = (median, step, measured, memory["predicted_mib"])
        pairs = "  ".join(
            f"{t:.0f} | {r:.0f} / {p:.0f} ({t / p:.2f} | {r / p:.2f})"
            for t, r, p in zip(measured["tensors"], measured["resident"], memory["predicted_mib"])
        )
        print(f"{name:<24}{median:>11.3f}{step:>10.3f}{step / median:>7.2f}  {pairs}")
    figures(args, rows, runs["auto"])
    refit(runs)


def _replicas(result: dict) -> int:
    """D of a run's plan: the batches it trains per step."""
    return result["plan"].get("data_parallel_size", 1)


def figures(args: argparse.Namespace, rows: dict, auto_runs: list[dict]) -> None:
    """Auto against the fastest grid plan; the predictions' worst errors; the limit."""
    grid = {name: row for name, row in rows.items() if name != "auto"}
    print()
    if "auto" not in rows or not grid:
        print("no figure: auto or every grid plan failed")
        return
    fastest = min(grid, key=lambda name: grid[name][0])
    auto = rows["auto"][0]
    for chosen in (r["plan"] for r in auto_runs if "plan" in r):
        print(f"auto chose {_options(chosen)} balance {chosen['balance']}")
    best = grid[fastest][0]
    print(f"auto / fastest of {len(grid)} feasible grid plans ({fastest}): {auto:.3f} / {best:.3f} = {auto / best:.3f}")
    times = [step / median for median, step, _, _ in grid.values()]
    print(f"predicted / measured step time over the grid: {min(times):.2f} .. {max(times):.2f}")
    for kind in ("tensors", "resident"):
        memory = [m / p for _, _, peaks, predicted in grid.values() for m, p in zip(peaks[kind], predicted)]
        worst = max(m for _, _, peaks, _ in rows.values() for m in peaks[kind])
        print(
            f"measured / predicted peak per stage over the grid, {kind}: {min(memory):.2f} .. {max(memory):.2f};"
            f" largest of any plan {worst:.0f} MiB against the limit {args.limit_mib:g} MiB"
        )


def refit(runs: dict[str, list[dict]]) -> None:
    """Fit ``CostModel.compute_scale``, ``step_overhead``, ``micro_batch_overhead`` and ``copy_bandwidth`` to every
    measured run (least squares on the relative error; the other constants as they are) and print them with the
    predictions' range under them: how the defaults were calibrated, and how to recalibrate on another machine
    (docs/planning.md, "Calibrating"). The step is taken as linear in the step overhead, the scale, the overhead per
    micro-batch and the copy's seconds per byte: ``step + scale * T(layers) + micro * dT/dmicro + copy * dT/dcopy``."""
    base = CostModel(micro_batch_overhead=0.0, step_overhead=0.0, compute_scale=1.0, copy_bandwidth=math.inf)
    rows = []  # (measured, [1, predicted without overheads, d predicted / d micro, d predicted / d copy])
    for result in (r for results in runs.values() for r in results if "failed" not in r):
        profiled, plan, factor = _profiled(result["profiled"]), _plan(result), result["state_factor"]

        def step(model: CostModel, plan=plan, profiled=profiled, factor=factor) -> float:
            return predict(plan, profiled, model, factor, float("inf")).step_time

        zero = step(base)
        micro = (step(dataclasses.replace(base, micro_batch_overhead=1e-3)) - zero) / 1e-3
        copy = (step(dataclasses.replace(base, copy_bandwidth=1e9)) - zero) / 1e-9
        rows.append((result["median_s"], [1.0, zero, micro, copy]))
    if len(rows) < 4:
        return
    step_s, scale, micro_s, copy_s = _non_negative_least_squares([[x / m for x in xs] for m, xs in rows])
    ratios = [(step_s + scale * xs[1] + micro_s * xs[2] + copy_s * xs[3]) / m for m, xs in rows]
    bandwidth = f"{1 / copy_s:.3g}" if copy_s else "math.inf"
    print(
        f"fitted to these {len(rows)} runs: CostModel(compute_scale={scale:.3f}, step_overhead={step_s:.4f},"
        f" micro_batch_overhead={micro_s:.5f}, copy_bandwidth={bandwidth}); predicted / measured step time with it:"
        f" {min(ratios):.2f} .. {max(ratios):.2f}"
    )


def _non_negative_least_squares(a: list[list[float]]) -> list[float]:
    """The x >= 0 minimising |a x - 1|: the best least-squares fit over every subset of the unknowns left free (the
    others 0) whose solution has no negative part (a few unknowns: 2^n subsets)."""
    n, best, best_error = len(a[0]), [0.0] * len(a[0]), float(len(a))
    for free in (s for size in range(1, n + 1) for s in combinations(range(n), size)):
        try:
            solved = _least_squares([[row[i] for i in free] for row in a], [1.0] * len(a))
        except ZeroDivisionError:  # a singular subset: some other subset covers it
            continue
        if min(solved) < 0:
            continue
        x = [0.0] * n
        for i, value in zip(free, solved):
            x[i] = value
        error = sum((sum(r * v for r, v in zip(row, x)) - 1) ** 2 for row in a)
        if error < best_error:
            best, best_error = x, error
    return best


def _least_squares(a: list[list[float]], b: list[float]) -> list[float]:
    """The x minimising |a x - b|, from the normal equations (Gaussian elimination; a few unknowns)."""
    n = len(a[0])
    m = [[sum(r[i] * r[j] for r in a) for j in range(n)] + [sum(r[i] * y for r, y in zip(a, b))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _profiled(data: dict) -> ProfiledCosts:
    large, small = ([LayerCost(**c) for c in data[key]] for key in ("large", "small"))
    return ProfiledCosts(tuple(data["rows"]), large, small, data["batch_rows"], data["input_bytes"])


def _plan(result: dict) -> PipelinePlan:
    plan = result["plan"]
    keys = ("pipeline_parallel_size", "data_parallel_size", "chunks", "checkpoint", "schedule")
    extras = (plan.get("virtual_stages", 1), plan.get("sharding_strategy", "NO_SHARD"), plan.get("offload"))
    return PipelinePlan(*(plan[key] for key in keys), tuple(plan["balance"]), *extras)


if __name__ == "__main__":
    main()
