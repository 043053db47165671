"""Speed-up of GPipeStrategy over plain Lightning, on CPU, measured side by side.

The same LightningModule: a balanced backbone of 8 x (Linear(W, W), ReLU) in an
``nn.Sequential`` named ``backbone``, then a Linear(W, 10) head and cross-entropy
against random labels; synthetic data, SGD.

  A  plain Lightning, one process, one torch thread:
     ``Trainer(accelerator="cpu", devices=1)``
  B  GPipe, two stage processes of one thread each:
     ``Trainer(strategy=GPipeStrategy(chunks=8, checkpoint=...), accelerator="cpu", devices=2)``

Both get the same CPU budget per stage (one thread), so the ratio A / B is the
pipeline's speed-up. With K stages and M micro-batches the GPipe schedule takes
(M + K - 1) micro-batch stage-times where one process takes K * M, so the ideal is
K * M / (M + K - 1) = K * (1 - bubble): 16/9 = 1.78x for K = 2, M = 8 (bubble 1/9),
before transfers, the head (on the last stage only) and the optimizer step.

The figure is the time per optimizer step in steady state: on global rank 0, the
time between consecutive ``on_train_batch_end`` calls after the warm-up steps
(so it includes data loading, the optimizer step and every hook). Under GPipe,
rank 0 is the first stage, and one step cannot end on it before the drain has
come back through every stage, so its period is the pipeline's.

The machine this runs on may be shared, so absolute times mean little: the driver
interleaves the runs (A, B, A, B, ...), each a fresh process, and compares medians.
Each run also reports, per process, its CPU seconds per step and the share of the
time its main thread was runnable but waiting for a CPU; runs where that share
passes 10% are flagged as contended (B needs one free CPU per stage at once, so
other work on the machine slows it more than A). ``--settle`` waits for an idle
machine before each run.

Usage::

    python benchmarks/speedup.py                      # 5 x (A, B), checkpoint="never"
    python benchmarks/speedup.py --checkpoint never except_last   # A, B(never), B(except_last), ...
    python benchmarks/speedup.py --repeats 3 --steps 10 --chunks 4
    python benchmarks/speedup.py --settle 120         # wait up to 2 min for an idle machine before each run

Internally the driver runs ``speedup.py --run plain|gpipe ...`` as a subprocess per
measurement; that child prints one JSON line per process, the step times on global
rank 0's. The gpipe child is re-run once more by Lightning's launcher for stage 1
(like ``torchrun``, inheriting its stdout), which is why everything below is behind
``if __name__ == "__main__"``.
"""

import argparse
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time

CHECKPOINT_MODES = ("never", "except_last", "always")

# launcher state that must not leak from the driver's environment into a fresh measurement
_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats of each configuration (default 5)")
    parser.add_argument("--steps", type=int, default=12, help="measured optimizer steps per run (default 12)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per run, not measured (default 3)")
    parser.add_argument("--chunks", type=int, default=8, help="GPipe micro-batches per mini-batch (default 8)")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per mini-batch (default 1024)")
    parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer (default 1024)")
    parser.add_argument("--depth", type=int, default=8, help="(Linear, ReLU) pairs in the backbone (default 8)")
    parser.add_argument("--devices", type=int, default=2, help="GPipe stages, one process each (default 2)")
    parser.add_argument(
        "--checkpoint",
        nargs="+",
        choices=CHECKPOINT_MODES,
        default=["never"],
        help="GPipe re-materialization mode(s); several are interleaved in one run (default never)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to SECONDS for the other processes on the machine to use less than a\n"
        "quarter of a CPU (default 0: do not wait)",
    )
    parser.add_argument("--run", choices=("plain", "gpipe"), help=argparse.SUPPRESS)  # internal: one measurement
    args = parser.parse_args(argv)
    for name in ("repeats", "steps", "chunks", "batch_size", "width", "depth", "devices"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    return args


# --------------------------------------------------------------------------- one measurement (child process)


def measure(args: argparse.Namespace) -> None:
    """Fit once (``--run plain`` or ``--run gpipe``); global rank 0 prints one JSON line."""
    import torch

    torch.set_num_threads(1)  # A: the one thread; B: what Lightning's launcher would pick on 2 cores
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(self, width: int, depth: int) -> None:
            super().__init__()
            self.backbone = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
            self.head = nn.Linear(width, 10)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.head(self.backbone(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Repeat(torch.utils.data.Dataset):
        """The same synthetic mini-batch, ``length`` times (no data-loading cost)."""

        def __init__(self, batch, length: int) -> None:
            self.batch, self.length = batch, length

        def __len__(self) -> int:
            return self.length

        def __getitem__(self, index: int):
            return self.batch

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.waits: list[float] = []  # seconds this process had spent runnable but not running
            self.cpu: list[float] = []  # CPU seconds of this process (all its threads, gloo's included)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())
            self.waits.append(_run_queue_wait())
            self.cpu.append(time.process_time())

    total = args.warmup + args.steps
    generator = torch.Generator().manual_seed(0)
    batch = (
        torch.randn(args.batch_size, args.width, generator=generator),
        torch.randint(0, 10, (args.batch_size,), generator=generator),
    )
    loader = torch.utils.data.DataLoader(Repeat(batch, total), batch_size=None, shuffle=False, num_workers=0)
    torch.manual_seed(0)
    model = Net(args.width, args.depth)
    timer = StepTimer()
    common = {
        "accelerator": "cpu",
        "max_steps": total,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "callbacks": [timer],
    }
    if args.run == "plain":
        trainer = pl.Trainer(devices=1, **common)
    else:
        from lightning_gpipe import GPipeStrategy

        (mode,) = args.checkpoint
        strategy = GPipeStrategy(chunks=args.chunks, checkpoint=mode)
        trainer = pl.Trainer(strategy=strategy, devices=args.devices, **common)
    trainer.fit(model, loader)
    # periods between consecutive step ends; the first measured one starts at the end of the last warm-up step
    # (with --warmup 0, the first step has no start mark and is dropped)
    first = max(args.warmup - 1, 0)
    ends = timer.ends[first:]
    times = [b - a for a, b in itertools.pairwise(ends)]
    waited = timer.waits[-1] - timer.waits[first]
    usage = {
        "rank": trainer.global_rank,
        "cpu_s": (timer.cpu[-1] - timer.cpu[first]) / len(times),  # CPU seconds per step of this process
        "runq_wait": waited / (ends[-1] - ends[0]),  # share of the measured time its main thread waited for a CPU
    }
    if trainer.global_rank != 0:
        print(json.dumps(usage), flush=True)  # the other stages' CPU use, for the driver's diagnostics
        return
    record = {
        **usage,
        "run": args.run,
        "checkpoint": args.checkpoint[0] if args.run == "gpipe" else None,
        "median_s": statistics.median(times),
        "step_s": times,
        "threads": torch.get_num_threads(),
        "steps": len(times),
        "world_size": trainer.world_size,
    }
    print(json.dumps(record), flush=True)


def _run_queue_wait() -> float:
    """Seconds the calling thread has waited on a run queue (CPU contention), from /proc; 0 where unavailable."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


# --------------------------------------------------------------------------- driver


def child_command(args: argparse.Namespace, run: str, checkpoint: str | None, devices: int) -> list[str]:
    command = [sys.executable, os.path.abspath(__file__), "--run", run, "--devices", str(devices)]
    for name in ("steps", "warmup", "chunks", "batch_size", "width", "depth"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if checkpoint is not None:
        command += ["--checkpoint", checkpoint]
    return command


def run_child(command: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env["OMP_NUM_THREADS"] = "1"  # one thread per process; Lightning's launcher keeps what is set
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    main = [r for r in records if "run" in r]
    if proc.returncode != 0 or not main:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"measurement failed (exit {proc.returncode}): {shlex.join(command)}")
    record = main[-1]
    record["stages"] = sorted((r for r in records if "run" not in r), key=lambda r: r["rank"])
    return record


CONTENDED = 0.10  # a run whose processes waited for a CPU more than this share of the time is flagged


def _busy_cpus(interval: float = 1.0) -> float | None:
    """CPUs kept busy by the whole machine over ``interval`` seconds (the driver itself sleeps), from /proc/stat."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields[:8]) - idle, sum(fields[:8])

    try:
        busy0, total0 = sample()
        time.sleep(interval)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(total1 - total0, 1)


def settle(limit: float) -> str:
    """Wait up to ``limit`` seconds for the machine to be idle; describe what was found."""
    deadline = time.perf_counter() + limit
    while True:
        busy = _busy_cpus()
        if busy is None:
            return ""
        if busy < 0.25 or time.perf_counter() >= deadline:
            return f"; machine busy {busy:.1f} CPUs before"
        time.sleep(2.0)


def drive(args: argparse.Namespace) -> None:
    import torch  # for the versions only

    # C: the same micro-batched work as B in one process (GPipeStrategy on 1 device), which tells the
    # pipeline's own gain apart from what smaller matrix products cost
    configs = [("A", "plain", None, 1), ("C/never", "gpipe", "never", 1)]
    configs += [(f"B/{mode}", "gpipe", mode, args.devices) for mode in args.checkpoint]
    print("command:  " + shlex.join([sys.executable, *sys.argv]))
    print(
        f"settings: backbone {args.depth} x (Linear({args.width}, {args.width}), ReLU) + Linear({args.width}, 10) +"
        f" cross-entropy, batch {args.batch_size} rows, SGD; {args.warmup} warm-up + {args.steps} measured steps"
        f" per run; {args.repeats} interleaved repeats"
    )
    print("  A          plain Lightning, Trainer(accelerator='cpu', devices=1), 1 process x 1 thread")
    print(
        f"  C/never    GPipeStrategy(chunks={args.chunks}, checkpoint='never'), devices=1: B's micro-batched work in"
        " 1 process x 1 thread"
    )
    for mode in args.checkpoint:
        print(
            f"  B/{mode:<10} GPipeStrategy(chunks={args.chunks}, checkpoint={mode!r}), devices={args.devices},"
            f" {args.devices} processes x 1 thread, micro-batches of ~{-(-args.batch_size // args.chunks)} rows"
        )
    print(f"host:     {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; torch {torch.__version__}")
    print("figure:   median time per optimizer step (s) on global rank 0, in steady state", flush=True)
    print(
        "also:     per process (rank 0/rank 1): CPU seconds per step, all threads; share of the time its main"
        " thread was runnable but waiting for a CPU (0% = the machine was ours)",
        flush=True,
    )
    print()

    results: dict[str, list[float]] = {name: [] for name, *_ in configs}
    busiest: dict[str, list[float]] = {name: [] for name, *_ in configs}  # CPU s/step of the busiest process
    contended: dict[str, list[bool]] = {name: [] for name, *_ in configs}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for name, run, mode, devices in configs:
            found = settle(args.settle) if args.settle > 0 else ""
            record = run_child(child_command(args, run, mode, devices))
            results[name].append(record["median_s"])
            spread = f"{min(record['step_s']):.3f}-{max(record['step_s']):.3f}"
            ranks = [record, *record["stages"]]
            busiest[name].append(max(r["cpu_s"] for r in ranks))
            contended[name].append(max(r["runq_wait"] for r in ranks) > CONTENDED)
            cpu = "/".join(f"{r['cpu_s']:.2f}" for r in ranks)
            wait = "/".join(f"{100 * r['runq_wait']:.0f}%" for r in ranks)
            print(
                f"repeat {repeat + 1}  {name:<14} {record['median_s']:.3f} s/step  (range {spread} s;"
                f" {record['world_size']} x {record['threads']} thread; CPU s/step {cpu}; waited for a CPU {wait}"
                f"{found}){'  [contended]' if contended[name][-1] else ''}",
                flush=True,
            )
    elapsed = time.perf_counter() - started

    print()
    header = f"{'config':<14}" + "".join(f"  rep{i + 1:<4}" for i in range(args.repeats)) + "  median"
    print(header)
    for name, values in results.items():
        marks = ["*" if c else " " for c in contended[name]]
        print(
            f"{name:<14}"
            + "".join(f"  {v:6.3f}{m}" for v, m in zip(values, marks))
            + f"  {statistics.median(values):6.3f}"
        )
    if any(any(c) for c in contended.values()):
        print(f"* contended: a process of that run waited for a CPU more than {100 * CONTENDED:.0f}% of the time")
    print()
    plain = statistics.median(results["A"])
    ideal = args.devices * args.chunks / (args.chunks + args.devices - 1)
    for name, *_ in configs[1:]:
        gpipe = statistics.median(results[name])
        pairs = [a / b for a, b in zip(results["A"], results[name])]
        print(
            f"speedup {name}: median(A) / median({name}) = {plain:.3f} / {gpipe:.3f} = {plain / gpipe:.2f}x"
            f"   (per-repeat A/B ratios: {', '.join(f'{r:.2f}' for r in pairs)})"
        )
        clean_a = [v for v, c in zip(results["A"], contended["A"]) if not c]
        clean_b = [v for v, c in zip(results[name], contended[name]) if not c]
        if len(clean_b) < len(results[name]) and clean_a and clean_b:
            a, b = statistics.median(clean_a), statistics.median(clean_b)
            print(
                f"  uncontended runs only ({len(clean_a)} A, {len(clean_b)} {name}): {a:.3f} / {b:.3f} = {a / b:.2f}x"
            )
        elif not clean_b:
            print(f"  every {name} run was contended: the machine was not free, this ratio understates the pipeline")
    micro = statistics.median(results["C/never"])
    for name, *_ in configs[2:]:
        gpipe = statistics.median(results[name])
        print(
            f"pipeline gain {name}: median(C/never) / median({name}) = {micro:.3f} / {gpipe:.3f} ="
            f" {micro / gpipe:.2f}x   (the same micro-batched work on 1 process vs {args.devices})"
        )
    print(
        f"ideal for {args.devices} stages, {args.chunks} micro-batches: K*M/(M+K-1) = {ideal:.2f}x (compute only;"
        " target >= 1.4x for 2 stages)"
    )
    # A model, not a measurement: what the step would take if every process had its own CPU, from CPU time
    # alone (the busiest stage's CPU time stretched by the bubble); it tells the cost of the work itself
    # (smaller GEMMs, transfers, the head) apart from the cost of sharing the machine.
    cpu_plain = statistics.median(busiest["A"])
    for name, _, _, devices in configs[1:]:
        cpu_stage = statistics.median(busiest[name])
        estimate = cpu_plain / (cpu_stage * (args.chunks + devices - 1) / args.chunks)
        print(
            f"CPU-time estimate {name} (model, not measured): A {cpu_plain:.3f} CPU s/step, busiest stage"
            f" {cpu_stage:.3f} CPU s/step; {cpu_plain:.3f} / ({cpu_stage:.3f} * {args.chunks + devices - 1}"
            f"/{args.chunks}) = {estimate:.2f}x without contention"
        )
    print(f"wall time {elapsed:.0f} s; load average {os.getloadavg()[0]:.2f} at end")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run is None:
        drive(args)
    else:
        if args.run == "gpipe" and len(args.checkpoint) != 1:
            raise SystemExit("--run gpipe takes one --checkpoint mode")
        measure(args)


if __name__ == "__main__":
    main()
