"""The benchmarks' shared driver: fresh-process measurements, interleaved repeats, medians, contention.

Every benchmark script is a *driver*: it builds one command line per configuration (a run of
``benchmarks/_runs.py``), runs the configurations in turn (A, B, C, A, B, C, ...) as fresh processes,
and compares medians, because the machine is shared and absolute times mean nothing. A measured
process prints one JSON line per process (see :class:`StepClock`); this module reads them back.

Contention: each process reports the share of its measured time its main thread was runnable but
waiting for a CPU (from ``/proc/self/task/*/schedstat``). A run where some process waited more than
:data:`CONTENDED` of the time, or whose machine lost that share of its CPU time to other virtual machines (the
hypervisor's "steal" in /proc/stat, which run-queue waits do not show), is flagged: a pipeline needs one free CPU
per stage at once, so other work on the machine slows it more than a one-process baseline.
"""

import json
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

CONTENDED = 0.10
"""A run whose processes waited for a CPU more than this share of the measured time is flagged."""

_LAUNCH_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT")
"""Launcher state that must not leak from the driver's environment into a fresh measurement."""

RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_runs.py")
"""The script that makes one measurement (see its docstring)."""


# --------------------------------------------------------------------------- inside a measured process


def run_queue_wait() -> float:
    """Seconds the calling thread has waited on a run queue (CPU contention), from /proc; 0 where unavailable."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (VmHWM), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StepClock:
    """Marks the end of each training step; summarises the steady-state period and CPU use.

    Call :meth:`mark` once after every step (warm-up included), then :meth:`summary`.

    Args:
        warmup: steps at the start that are not measured; the first measured period starts at the end of the
            last warm-up step (with 0, the first step has no start mark and is dropped).
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.ends: list[float] = []
        self.waits: list[float] = []  # seconds this thread had spent runnable but not running
        self.cpu: list[float] = []  # CPU seconds of this process (all its threads)
        self.main_cpu: list[float] = []  # CPU seconds of this thread (the one that marks the steps)

    def mark(self) -> None:
        """Record the end of one step."""
        self.ends.append(time.perf_counter())
        self.waits.append(run_queue_wait())
        self.cpu.append(time.process_time())
        self.main_cpu.append(time.thread_time())

    def summary(self) -> dict:
        """``median_s`` (median step period, s), ``step_s`` (every period), ``cpu_s`` (CPU s per step, all
        threads), ``main_cpu_s`` (CPU s per step of the thread that marks the steps), ``runq_wait`` (share of the
        measured time the main thread waited for a CPU), ``peak_rss_mib``."""
        first = max(self.warmup - 1, 0)
        ends = self.ends[first:]
        times = [b - a for a, b in zip(ends, ends[1:])]
        if not times:
            raise RuntimeError(f"{len(self.ends)} steps marked: too few for a period after {self.warmup} warm-up")
        return {
            "median_s": statistics.median(times),
            "step_s": times,
            "cpu_s": (self.cpu[-1] - self.cpu[first]) / len(times),
            "main_cpu_s": (self.main_cpu[-1] - self.main_cpu[first]) / len(times),
            "runq_wait": (self.waits[-1] - self.waits[first]) / (ends[-1] - ends[0]),
            "peak_rss_mib": peak_rss_mib(),
        }


def emit(rank: int, **record) -> None:
    """Print one measured process's result as the JSON line the driver reads (``rank`` first).

    One write per line: the stages of a Lightning run share one stdout, and Python may be unbuffered.
    """
    sys.stdout.write(json.dumps({"rank": rank, **record}) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- driver side


@dataclass
class Config:
    """One configuration of a benchmark.

    Args:
        name: short label in the tables, e.g. ``"K2/M8"``.
        args: arguments of ``benchmarks/_runs.py`` for one measurement.
        nprocs: processes the driver starts itself, with torch.distributed's ``RANK``/``WORLD_SIZE``/
            ``MASTER_*`` variables (1 for Lightning runs, whose launcher starts the other stages).
        describe: one line saying what runs, printed in the header.
        checkout: a directory holding another version of this repository (``git archive``): its
            ``benchmarks/_runs.py`` runs, importing its ``lightning_gpipe`` (``None``: this one's).
        script: the script to run instead of ``benchmarks/_runs.py`` (a benchmark that measures in processes of its
            own, e.g. on another number of them per configuration); ``None``: ``_runs.py``.
    """

    name: str
    args: list[str]
    nprocs: int = 1
    describe: str = ""
    checkout: str | None = None
    script: str | None = None


@dataclass
class Outcome:
    """What one measurement returned: the final JSON record of every process (sorted by rank), the events they
    reported on the way, the exit code, the end of their output and the wall time in seconds."""

    records: list[dict]
    returncode: int
    log: str = ""
    seconds: float = 0.0
    events: list[dict] = field(default_factory=list)  # e.g. {"rank": 1, "event": "trained", ...}, by rank

    @property
    def ok(self) -> bool:
        """The measurement finished and every process reported."""
        return self.returncode == 0 and bool(self.records)


@dataclass
class Series:
    """The repeats of one configuration: rank-0 medians, the busiest process's CPU s/step, contention flags, and
    every repeat's records (one per process, by rank)."""

    medians: list[float] = field(default_factory=list)
    busiest_cpu: list[float] = field(default_factory=list)
    contended: list[bool] = field(default_factory=list)
    records: list[list[dict]] = field(default_factory=list)

    def median(self, clean: bool = False) -> float | None:
        """Median over the repeats (``clean``: the uncontended ones only; ``None`` if there are none)."""
        values = [v for v, c in zip(self.medians, self.contended) if not (clean and c)]
        return statistics.median(values) if values else None


def clean_env(threads: int = 1) -> dict[str, str]:
    """The driver's environment without launcher state, with ``threads`` OpenMP threads per process."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("PL_")}
    env["OMP_NUM_THREADS"] = str(threads)  # Lightning's launcher keeps what is set
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(config: Config, memory_cap: int | None = None, timeout: float | None = None) -> Outcome:
    """Run one measurement of ``config`` in fresh processes and collect their JSON lines.

    Args:
        config: what to run.
        memory_cap: if given, ``RLIMIT_DATA`` in bytes for every process (children inherit it, so each
            Lightning stage process gets its own cap of this size).
        timeout: seconds before the processes are killed and the measurement counts as failed.
    """
    runs = RUNS if config.checkout is None else os.path.join(config.checkout, "benchmarks", "_runs.py")
    command = [sys.executable, config.script or runs, *config.args]
    env = clean_env()
    if config.checkout is not None:  # Lightning's launcher passes it on to the other stage processes
        env["PYTHONPATH"] = os.pathsep.join([config.checkout, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    port = str(_free_port())

    def limit() -> None:
        if memory_cap is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (memory_cap, memory_cap))

    procs = []
    for rank in range(config.nprocs):
        rank_env = env if config.nprocs == 1 else {**env, "RANK": str(rank), "WORLD_SIZE": str(config.nprocs)}
        rank_env = {**rank_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port} if config.nprocs > 1 else rank_env
        procs.append(
            subprocess.Popen(
                command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit
            )
        )
    started = time.perf_counter()
    deadline = None if timeout is None else started + timeout
    outputs, code = [], 0
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=None if deadline is None else max(deadline - time.perf_counter(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, err = proc.communicate()
            code = code or -9
        outputs.append((out, err))
        code = code or proc.returncode
    lines = [record for out, _ in outputs for record in _json_records(out)]
    lines.sort(key=lambda r: r["rank"])
    log = "".join(out[-3000:] + err[-3000:] for out, err in outputs)
    records, events = [r for r in lines if "event" not in r], [r for r in lines if "event" in r]
    return Outcome(records, code, log, time.perf_counter() - started, events)


def _json_records(text: str) -> list[dict]:
    """The ``{"rank": ...}`` objects printed in ``text``, also where two processes' lines ran together."""
    decoder, found = json.JSONDecoder(), []
    for line in text.splitlines():
        start = line.find('{"rank"')
        while start >= 0:
            record, end = decoder.raw_decode(line, start)
            found.append(record)
            start = line.find('{"rank"', end)
    return found


def run_or_exit(config: Config) -> Outcome:
    """:func:`run`, printing the processes' output and exiting if the measurement failed."""
    outcome = run(config)
    if not outcome.ok:
        sys.stderr.write(outcome.log)
        raise SystemExit(
            f"measurement failed (exit {outcome.returncode}): {shlex.join([config.script or RUNS, *config.args])}"
        )
    return outcome


def cpu_ticks() -> list[int] | None:
    """The machine's CPU time so far from /proc/stat: user, nice, system, idle, iowait, irq, softirq, steal
    (ticks, all CPUs); ``None`` where unavailable."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def _shares(before: list[int] | None, after: list[int] | None) -> list[float] | None:
    """Each :func:`cpu_ticks` field's share of the machine's CPU time between two samples; ``None`` without both."""
    if before is None or after is None:
        return None
    delta = [a - b for a, b in zip(after, before)]
    return [d / max(sum(delta), 1) for d in delta]


def _busy_cpus(interval: float = 1.0) -> float | None:
    """CPUs kept busy by the whole machine over ``interval`` seconds (the driver itself sleeps), from /proc/stat."""
    before = cpu_ticks()
    time.sleep(interval)
    shares = _shares(before, cpu_ticks())
    if shares is None:
        return None
    return (os.cpu_count() or 1) * (1 - shares[3] - shares[4])  # all but idle and iowait


def stolen_share(before: list[int] | None, after: list[int] | None) -> float:
    """Share of the machine's CPU time between two :func:`cpu_ticks` samples that the hypervisor gave to other
    virtual machines ("steal"): time none of our processes could run, which their run-queue waits do not show."""
    shares = _shares(before, after)
    return 0.0 if shares is None else shares[7]


def settle(limit: float) -> str:
    """Wait up to ``limit`` seconds for the rest of the machine to use under a quarter of a CPU; say what was found."""
    if limit <= 0:
        return ""
    deadline = time.perf_counter() + limit
    while True:
        busy = _busy_cpus()
        if busy is None:
            return ""
        if busy < 0.25 or time.perf_counter() >= deadline:
            return f"; machine busy {busy:.1f} CPUs before"
        time.sleep(2.0)


def add_timing_args(parser, repeats: int = 3, steps: int = 8, warmup: int = 2) -> None:
    """Add ``--repeats``, ``--steps``, ``--warmup`` and ``--settle`` (see :func:`interleave`) to ``parser``."""
    parser.add_argument("--repeats", type=int, default=repeats, help=f"interleaved repeats (default {repeats})")
    parser.add_argument("--steps", type=int, default=steps, help=f"measured steps per run (default {steps})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"unmeasured steps per run (default {warmup})")
    parser.add_argument(
        "--settle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to SECONDS for the rest of the machine to use under a quarter of a CPU",
    )


def mlp_run_args(args) -> list[str]:
    """The arguments of ``benchmarks/_runs.py`` that fix the MLP, the batch and the steps, from a driver's ``args``
    (``devices``, ``batch_size``, ``width``, ``depth``, ``steps``, ``warmup``)."""
    common = ["--devices", str(args.devices), "--batch-size", str(args.batch_size), "--width", str(args.width)]
    return common + ["--depth", str(args.depth), "--steps", str(args.steps), "--warmup", str(args.warmup)]


def print_command(settings: str) -> None:
    """Print the command line this driver was started with and a line of ``settings``."""
    print("command:  " + shlex.join([sys.executable, *sys.argv]))
    print(f"settings: {settings}")


def print_header(settings: str, configs: list[Config], figure: str) -> None:
    """Print the command line, the settings, one line per configuration, the host and what the figure is."""
    import torch  # for the version only

    print_command(settings)
    for config in configs:
        print(f"  {config.name:<16} {config.describe}")
    print(f"host:     {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; torch {torch.__version__}")
    print(f"figure:   {figure}")
    print(
        "also:     per process (rank 0/rank 1/...): CPU seconds per step, all threads; share of the time its main"
        " thread was runnable but waiting for a CPU (0% = the machine was ours); share of the machine's CPU time"
        " the hypervisor gave to other virtual machines (stolen)"
    )
    print(flush=True)


def interleave(configs: list[Config], repeats: int, settle_s: float = 0.0) -> dict[str, Series]:
    """Run every configuration ``repeats`` times, interleaved (A, B, ..., A, B, ...), printing each run.

    Args:
        configs: what to run.
        repeats: runs of each configuration.
        settle_s: see :func:`settle`, before each run.

    Returns:
        The series of each configuration, by name.
    """
    results = {config.name: Series() for config in configs}
    for repeat in range(repeats):
        for config in configs:
            found, ticks = settle(settle_s), cpu_ticks()
            records = run_or_exit(config).records
            stolen = stolen_share(ticks, cpu_ticks())
            main, series = records[0], results[config.name]
            series.medians.append(main["median_s"])
            series.records.append(records)
            series.busiest_cpu.append(max(r["cpu_s"] for r in records))
            series.contended.append(max(max(r["runq_wait"] for r in records), stolen) > CONTENDED)
            cpu = "/".join(f"{r['cpu_s']:.4f}" for r in records)
            wait = "/".join(f"{100 * r['runq_wait']:.0f}%" for r in records)
            found += "; B/W split" if main.get("split") else ""
            print(
                f"repeat {repeat + 1}  {config.name:<16} {main['median_s']:.4f} s/step  (range"
                f" {min(main['step_s']):.4f}-{max(main['step_s']):.4f} s; CPU s/step {cpu}; waited for a CPU {wait};"
                f" stolen {100 * stolen:.0f}%{found}){'  [contended]' if series.contended[-1] else ''}",
                flush=True,
            )
    return results


def drive(settings: str, configs: list[Config], args, summarise: Callable[[dict[str, Series]], None]) -> None:
    """The whole of a timing benchmark: header, interleaved runs (``args.repeats``, ``args.settle``), the table,
    then ``summarise(results)``, then the wall time."""
    print_header(settings, configs, "median time per optimizer step (s) on global rank 0")

    def body() -> None:
        results = interleave(configs, args.repeats, args.settle)
        print_table(results)
        summarise(results)

    timed(body)


def print_table(results: dict[str, Series]) -> None:
    """Print every configuration's per-repeat medians and their median (``*`` marks contended runs)."""
    repeats = max(len(s.medians) for s in results.values())
    print()
    print(f"{'config':<16}" + "".join(f"  rep{i + 1:<4}" for i in range(repeats)) + "   median")
    for name, series in results.items():
        cells = "".join(f"  {v:7.4f}{'*' if c else ' '}" for v, c in zip(series.medians, series.contended))
        print(f"{name:<16}{cells}  {series.median():7.4f}")
    if any(any(s.contended) for s in results.values()):
        print(
            f"* contended: a process of that run waited for a CPU, or the hypervisor stole the CPUs, more than"
            f" {100 * CONTENDED:.0f}% of the time"
        )
    print()


def print_ratio(label: str, numerator: Series, denominator: Series, num_name: str, den_name: str) -> float:
    """Print ``median(numerator) / median(denominator)`` with the per-repeat ratios, the same ratio of the busiest
    process's CPU seconds per step (less sensitive to other load), and the uncontended-only ratio when some runs
    were contended; return the ratio. For step times, A / B is B's speed-up over A."""
    a, b = numerator.median(), denominator.median()
    pairs = ", ".join(f"{x / y:.2f}" for x, y in zip(numerator.medians, denominator.medians))
    print(f"{label}: median({num_name}) / median({den_name}) = {a:.4f} / {b:.4f} = {a / b:.2f}x  (per repeat: {pairs})")
    cpu_a, cpu_b = statistics.median(numerator.busiest_cpu), statistics.median(denominator.busiest_cpu)
    print(f"    CPU s/step of the busiest process: {cpu_a:.4f} / {cpu_b:.4f} = {cpu_a / cpu_b:.2f}x")
    if any(numerator.contended + denominator.contended):
        clean_a, clean_b = numerator.median(clean=True), denominator.median(clean=True)
        if clean_a is not None and clean_b is not None:
            print(f"    uncontended runs only: {clean_a:.4f} / {clean_b:.4f} = {clean_a / clean_b:.2f}x")
        else:
            print("    no uncontended runs on one side: the machine was not free")
    return a / b


def check_positive(parser, args, names: tuple[str, ...]) -> None:
    """Exit through ``parser.error`` unless every attribute in ``names`` of ``args`` (ints or lists of ints) is >= 1."""
    for name in names:
        value = getattr(args, name)
        if any(v < 1 for v in (value if isinstance(value, list) else [value])):
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def timed(fn: Callable[[], None]) -> None:
    """Run ``fn`` and print the wall time and the load average at the end."""
    started = time.perf_counter()
    fn()
    print(f"wall time {time.perf_counter() - started:.0f} s; load average {os.getloadavg()[0]:.2f} at end")
