"""Throughput of our GPipe engine against torch.distributed.pipelining's ScheduleGPipe and torchgpipe, on CPU.

The same balanced MLP (benchmarks/models.py: backbone split evenly by parameters, head on the last stage),
the same mini-batch, the same M, the same initial weights, SGD, ``checkpoint="never"`` everywhere by default
(ScheduleGPipe has no re-materialization of its own; ``--checkpoint`` sets ours and torchgpipe's). For each M:

  plain    plain Lightning, no pipeline: 1 process x 1 thread (ratios over it are speed-ups)
  ours/L   GPipeStrategy through Lightning's Trainer with its defaults: K processes x 1 thread (the user-facing cost;
           the default chooses whole backwards or the B/W split from the profiled layers)
  ours/LB  ours/L with whole backwards fixed (``defer_weight_grad=False``)
  ours/E   our engine alone (ModelChunk, Partition, Link) in K torch.distributed processes x 1 thread, no Trainer
  ours/LW, ours/EW   the same with deferred weight gradients (``defer_weight_grad=True``, the B/W split)
  tp       PipelineStage + ScheduleGPipe in K torch.distributed processes x 1 thread
  tp/I1F1B, tp/ZB, tp/ZBV   torch's ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble and
           ScheduleZBVZeroBubble: 2 stages per process (the backbone split into 2K parts), K processes x 1 thread
  ours/L-v2, ours/L-1f1b-v2   GPipeStrategy(virtual_stages=2): looped fill-drain and interleaved 1F1B (Narayanan
           et al. 2021), 2 model chunks per process
  tgp      torchgpipe GPipe(devices=["cpu"] * K) in ONE process: a worker thread per partition, one torch
           intra-op thread, so the partitions share one Python interpreter (and its GIL)
  ours/LW-1f1b, ours/EW-1f1b   1F1B with the B/W split (``defer_weight_grad=True``)
  ours/L-zb, ours/E-zb   zero-bubble ZB-H1 (Qi et al. 2023): GPipeStrategy(schedule="zb-h1"), our engine's ZB-H1 plans
  ours/L-zb1p   zero-bubble ZB-1p: GPipeStrategy(schedule="zb-1p"), each W placed by the profiled B and W times
  ours/L-zbv    zero-bubble ZB-V: GPipeStrategy(schedule="zb-v"), two chunks per process in a V, W placed by cost
  ours/L-1f1b, ours/E-1f1b, tp/1F1B   1F1B (PipeDream-Flush, Narayanan et al. 2021): GPipeStrategy(schedule="1f1b"),
           our engine's 1F1B plans, torch's Schedule1F1B; "1F1B over fill-drain" lines compare each
           with its fill-drain twin (the same bubble: about 1.00 expected)

With ``--before REF`` (a git revision of this repository), ``before/L`` (and ``before/E``, ``before/L-1f1b``,
``before/LW``, ``before/L-zb1p``, ``before/L-zbv`` when their ours/* run) is ours/L as that revision's code runs it: its
``benchmarks/_runs.py`` and its package, from ``git archive REF``, in the same interleaved run, so a change of the
engine is measured as not slower ("ours/L vs before/L" close to 1.00).

The figure is rank 0's steady-state time per optimizer step; throughput ratios are time ratios, e.g.
median(tp) / median(ours/L) > 1 means we train faster than ScheduleGPipe. Runs are interleaved fresh processes.

Usage::

    python benchmarks/compare.py                       # K=2, batch 1024, M in {8, 32}
    python benchmarks/compare.py --chunks 8 64 --width 256
    python benchmarks/compare.py --chunks 8 --only ours/L ours/L-1f1b --before f22351e
    python benchmarks/compare.py --chunks 8 --only plain ours/L-zb tp --ceiling   # how close to the machine's limit

With ``--ceiling`` the run first measures ``hardware.py``'s two facts on the same width and batch (what M
micro-batches cost one thread, and what two processes side by side cost each other) and prints, for each ours/*,
its speed-up over plain as a share of the ceiling they imply, with fill-drain's bubble and with none.
"""

import argparse
import os
import statistics
import subprocess
import tarfile
import tempfile

import _harness as harness

KINDS = {
    "plain": ("lightning", 1, ["--strategy", "plain"], "plain Lightning on one device, 1 process x 1 thread"),
    "ours/L": ("lightning", 1, [], "GPipeStrategy through the Trainer (its defaults), {k} processes x 1 thread"),
    "ours/LB": ("lightning", 1, ["--no-defer-weight-grad"], "ours/L with whole backwards (defer_weight_grad=False)"),
    "ours/E": ("bare", None, [], "our ModelChunk/Partition/Link without the Trainer, {k} processes x 1 thread"),
    "ours/LW": ("lightning", 1, ["--defer-weight-grad"], "ours/L with defer_weight_grad=True (B/W split)"),
    "ours/EW": ("bare", None, ["--defer-weight-grad"], "ours/E with deferred weight gradients (B/W split)"),
    "tp": ("tp", None, [], "torch.distributed.pipelining ScheduleGPipe, {k} processes x 1 thread"),
    "tp/ZB": ("tp-zb", None, [], "torch's ScheduleInterleavedZeroBubble, {k} processes x 2 stages x 1 thread"),
    "tp/ZBV": ("tp-zbv", None, [], "torch's ScheduleZBVZeroBubble (V shape), {k} processes x 2 stages x 1 thread"),
    "tgp": ("torchgpipe", 1, [], "torchgpipe GPipe, 1 process, {k} partition threads, 1 intra-op thread"),
    "ours/L-1f1b": ("lightning", 1, ["--schedule", "1f1b"], "ours/L with schedule='1f1b'"),
    "ours/E-1f1b": ("bare", None, ["--schedule", "1f1b"], "ours/E running 1F1B plans"),
    "tp/1F1B": ("tp-1f1b", None, [], "torch.distributed.pipelining Schedule1F1B, {k} processes x 1 thread"),
    "ours/LW-1f1b": ("lightning", 1, ["--schedule", "1f1b", "--defer-weight-grad"], "ours/L-1f1b with the B/W split"),
    "ours/EW-1f1b": ("bare", None, ["--schedule", "1f1b", "--defer-weight-grad"], "ours/E-1f1b with the B/W split"),
    "ours/L-zb": ("lightning", 1, ["--schedule", "zb-h1"], "ours/L with schedule='zb-h1' (zero-bubble ZB-H1)"),
    "ours/E-zb": ("bare", None, ["--schedule", "zb-h1"], "ours/E running ZB-H1 plans"),
    "ours/L-zb1p": ("lightning", 1, ["--schedule", "zb-1p"], "ours/L with schedule='zb-1p' (W placed by cost)"),
    "ours/L-zbv": ("lightning", 1, ["--schedule", "zb-v"], "ours/L with schedule='zb-v' (two chunks in a V)"),
    "ours/L-v2": ("lightning", 1, ["--virtual-stages", "2"], "ours/L with virtual_stages=2 (looped fill-drain)"),
    "ours/L-1f1b-v2": (
        "lightning",
        1,
        ["--schedule", "1f1b", "--virtual-stages", "2"],
        "ours/L with schedule='1f1b', virtual_stages=2 (interleaved 1F1B)",
    ),
    "tp/I1F1B": ("tp-i1f1b", None, [], "torch's ScheduleInterleaved1F1B, {k} processes x 2 stages x 1 thread"),
}
"""label -> (kind of benchmarks/_runs.py, processes the driver starts (None: K), its extra arguments, description).
The default run leaves out ``plain`` (``--only plain ...`` adds it)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2, help="K, stages (default 2)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 32], help="values of M (default 8 32)")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="features per Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="(Linear, ReLU) pairs (default 8)")
    parser.add_argument(
        "--checkpoint",
        choices=("never", "except_last", "always"),
        default="never",
        help="re-materialization of ours and tgp (default never; torch's schedules have none)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=tuple(KINDS), default=[k for k in KINDS if k != "plain"], help="pipelines to run"
    )
    parser.add_argument("--before", metavar="REF", help="also run ours/L as git revision REF runs it (before/L)")
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="first measure the machine's ceiling with hardware.py's probes (needs plain in --only)",
    )
    harness.add_timing_args(parser)
    args = parser.parse_args(argv)
    harness.check_positive(parser, args, ("devices", "chunks", "batch_size", "width", "depth", "repeats"))
    return args


BEFORE = {
    "before/E": "ours/E",
    "before/L": "ours/L",
    "before/L-1f1b": "ours/L-1f1b",
    "before/LW": "ours/LW",
    "before/L-zb1p": "ours/L-zb1p",
    "before/L-zbv": "ours/L-zbv",
}
"""label of a run of the ``--before`` revision -> the label of ours it repeats."""


def configs(args: argparse.Namespace, checkout: str | None = None) -> list[harness.Config]:
    """One configuration per (M, pipeline); with ``checkout`` (``--before``'s files), also its ``before/*`` runs."""
    common = harness.mlp_run_args(args)
    labels = [*args.only, *(b for b, o in BEFORE.items() if checkout is not None and o in args.only)]
    result = []
    for m in args.chunks:
        for label in labels:
            kind, nprocs, extra, describe = KINDS[BEFORE.get(label, label)]
            if label in BEFORE:
                describe = f"{BEFORE[label]} as revision {args.before} runs it"
            result.append(
                harness.Config(
                    f"{label}/M{m}",
                    [kind, *common, "--chunks", str(m), "--checkpoint", args.checkpoint, *extra],
                    nprocs=nprocs or args.devices,
                    describe=describe.format(k=args.devices) + f", M={m} (~{-(-args.batch_size // m)} rows)",
                    checkout=checkout if label in BEFORE else None,
                )
            )
    return result


def export(ref: str, into: str) -> str:
    """Write the files of git revision ``ref`` of this repository into the directory ``into``; returns ``into``.

    Raises:
        subprocess.CalledProcessError: if ``ref`` is not a revision of the repository.
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = os.path.join(into, "before.tar")
    subprocess.run(["git", "-C", root, "archive", "--format=tar", f"--output={archive}", ref], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved measurements and print the ratios."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="compare_before_") as scratch:
        grid = configs(args, export(args.before, scratch) if args.before else None)
        _drive(args, grid)


def _drive(args: argparse.Namespace, grid: list[harness.Config]) -> None:
    """Run ``grid`` interleaved and print the tables and ratios (with ``--ceiling``, the machine's ceiling first)."""
    settings = (
        f"{args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10), cross-entropy,"
        f" batch {args.batch_size}, SGD, K={args.devices}, checkpoint {args.checkpoint}; {args.warmup} warm-up +"
        f" {args.steps} measured steps per run; {args.repeats} interleaved repeats"
    )
    facts = machine_facts(args) if args.ceiling else None

    def report(results: dict[str, harness.Series]) -> None:
        summarise(args, results)
        if facts is not None:
            print_ceiling(args, results, facts)

    harness.drive(settings, grid, args, report)


def machine_facts(args: argparse.Namespace) -> dict[str, float]:
    """``hardware.py``'s two facts on this model's width and batch, measured now (interleaved repeats, medians):
    ``c(M)``, one thread's time for M micro-batches over one batch (``"M8"`` ...), and ``pairing``, two processes'
    GEMM time side by side over one alone."""
    import hardware

    probe = argparse.Namespace(width=args.width, rows=args.batch_size, steps=6, gemms=40)
    measures = {f"M{m}": (lambda m=m: hardware.micro(probe, m)) for m in (1, *args.chunks)}
    measures |= {"alone": lambda: hardware.paired(probe, 1), "paired": lambda: hardware.paired(probe, 2)}
    times: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(args.repeats):
        for name, measure in measures.items():
            times[name].append(measure()["median_s"])
    median = {name: statistics.median(values) for name, values in times.items()}
    facts = {f"M{m}": median[f"M{m}"] / median["M1"] for m in args.chunks}
    facts["pairing"] = median["paired"] / median["alone"]
    return facts


def print_ceiling(args: argparse.Namespace, results: dict[str, harness.Series], facts: dict[str, float]) -> None:
    """Each ``ours/*`` speed-up over plain as a share of the machine's ceiling: K stages of equal cost, nothing but
    micro-batching (``c(M)``) and pairing, and the schedule's bubble. One chunk per stage: fill-drain and 1F1B
    ``K M / ((M + K - 1) c p)``; with no bubble (zero-bubble's ideal) ``K / (c p)``."""
    k = args.devices
    for m in args.chunks:
        cost = facts[f"M{m}"] * facts["pairing"]
        bubbled, ideal = k * m / ((m + k - 1) * cost), k / cost
        print(
            f"\nceiling, M={m}: micro-batching {facts[f'M{m}']:.2f}x, pairing {facts['pairing']:.2f}x ->"
            f" {bubbled:.2f}x over plain with fill-drain's bubble, {ideal:.2f}x with none"
        )
        if f"plain/M{m}" not in results:
            continue
        plain = results[f"plain/M{m}"].median()
        for label in (label for label in args.only if label.startswith("ours/")):
            speedup = plain / results[f"{label}/M{m}"].median()
            shares = f"{speedup / bubbled:.2f} of the first, {speedup / ideal:.2f} of the second"
            print(f"  {label}: {speedup:.2f}x = {shares}")


SPLITS = (
    ("ours/LW", "ours/LB", "fill-drain, B/W split over whole backwards"),
    ("ours/L", "ours/LB", "the default's choice over whole backwards"),
    ("ours/L", "ours/LW", "the default's choice over the B/W split"),
    ("ours/LW-1f1b", "ours/L-1f1b", "1F1B, B/W split over whole backwards"),
    ("ours/L-zb", "ours/L-1f1b", "ZB-H1 over 1F1B"),
    ("ours/L-zb", "ours/LW-1f1b", "ZB-H1 over 1F1B with the B/W split"),
    ("ours/E-zb", "ours/E-1f1b", "ZB-H1 over 1F1B (bare engine)"),
    ("ours/L-v2", "ours/L", "2 virtual stages over 1 (fill-drain)"),
    ("ours/L-1f1b-v2", "ours/L-1f1b", "2 virtual stages over 1 (1F1B)"),
)
"""(label, the label it is compared with, what the ratio shows): > 1 when the first is faster."""


def summarise(args: argparse.Namespace, results: dict[str, harness.Series]) -> None:
    """For each M: each peer's time over ours (> 1: we are faster), and Lightning's cost over the bare engine."""
    ours = [label for label in args.only if label.startswith("ours/")]
    peers = [label for label in args.only if not label.startswith("ours/")]
    for m in args.chunks:
        for before, now in BEFORE.items():
            if f"{before}/M{m}" in results:
                a, b = f"{before}/M{m}", f"{now}/M{m}"
                harness.print_ratio(f"{now} vs {before} (> 1: faster now)", results[a], results[b], a, b)
        for a, b in [(f"{p}/M{m}", f"{o}/M{m}") for p in peers for o in ours]:
            harness.print_ratio(f"{b} vs {a}", results[a], results[b], a, b)
        for lightning, bare in (("ours/L", "ours/E"), ("ours/LW", "ours/EW"), ("ours/L-zb", "ours/E-zb")):
            if lightning in ours and bare in ours:
                a, b = f"{lightning}/M{m}", f"{bare}/M{m}"
                harness.print_ratio(f"Lightning's cost, M={m}", results[a], results[b], a, b)
        for one, fill in (("ours/L-1f1b", "ours/L"), ("ours/E-1f1b", "ours/E"), ("tp/1F1B", "tp")):
            if one in args.only and fill in args.only:
                a, b = f"{one}/M{m}", f"{fill}/M{m}"
                harness.print_ratio(f"1F1B over fill-drain, M={m}", results[a], results[b], a, b)
        for split, whole, what in SPLITS:
            if split in args.only and whole in args.only:
                a, b = f"{whole}/M{m}", f"{split}/M{m}"
                harness.print_ratio(f"{what}, M={m}", results[a], results[b], a, b)
    print_actions(results)


def print_actions(results: dict[str, harness.Series]) -> None:
    """Each run's CPU per step and per pipeline action, per process (rank 0/rank 1/...), medians over the repeats:
    of the main thread (which runs the actions) and of all threads. An action is the forward, the backward, or the
    B or W half of one micro-batch on one model chunk: M x (2, or 3 with the B/W split) x the process's model chunks
    a step (torchgpipe's one process runs every partition's)."""
    print(
        "\nCPU ms per step and per action (forward, backward, B or W of one micro-batch on one model chunk), per"
        " process (rank 0/rank 1/...), medians over the repeats; less sensitive to other load than the step time"
    )
    print(
        f"{'config':<16} {'actions':>7}  {'main thread /step':>18}  {'/action':>13}  {'all threads /step':>18}  /action"
    )
    for name, series in results.items():
        first = series.records[0][0]
        actions = int(name.rsplit("/M", 1)[1]) * (3 if first.get("split") else 2) * first.get("virtual_stages", 1)
        cells = []
        for key in ("main_cpu_s", "cpu_s"):
            per_rank = [1e3 * statistics.median(run[rank].get(key, float("nan")) for run in series.records)
                        for rank in range(len(series.records[0]))]  # fmt: skip
            cells.append("/".join(f"{v:.2f}" for v in per_rank))
            cells.append("/".join(f"{v / actions:.3f}" for v in per_rank))
        print(f"{name:<16} {actions:>7}  {cells[0]:>18}  {cells[1]:>13}  {cells[2]:>18}  {cells[3]}")


if __name__ == "__main__":
    main()
