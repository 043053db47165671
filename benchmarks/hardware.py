"""Two facts about the machine that a pipeline's speed-up rests on, re-measured here (issue 10).

1. **What micro-batching costs**: forward and backward of 4 x (``Linear(W, W)``, ``ReLU``) over N rows at
   once, against the same rows as M micro-batches of N/M rows (weight gradients accumulated, as the engine
   does). Above 1.00x, splitting the batch costs that much more time for the same arithmetic.
2. **Whether two processes slow each other**: one process timing W x W x W GEMMs alone, against two
   processes timing the same GEMMs at the same moment. Above 1.00x, a stage runs slower when its
   neighbour computes, and K stages on K CPUs cannot reach K times one process's speed.
3. **What several weight gradients at once save** (issue 21): the deferred weight gradients (W,
   ``lightning_gpipe.engine.weightgrad``) of the same 4-layer stack over M micro-batches, run one by one against
   ``run_together`` (one GEMM per Linear over the mini-batch's rows). Below 1.00x, running them together is faster.

Every probe runs in a fresh process with one torch thread, the configurations interleaved, medians over
the repeats (see ``_harness.py``)::

    python benchmarks/hardware.py                      # W=1024, N=1024, M in {8, 16}, 5 repeats
    python benchmarks/hardware.py --width 512 --chunks 8 32
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import clean_env, run_queue_wait  # noqa: E402


def _micro_batched(width: int, rows: int, chunks: int, steps: int) -> list[float]:
    """Seconds per forward+backward of the 4-layer stack over ``rows`` rows in ``chunks`` micro-batches."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    batch = torch.randn(rows, width)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        for part in batch.chunk(chunks):
            layers(part).sum().backward()
        times.append(time.perf_counter() - start)
        layers.zero_grad(set_to_none=True)
    return times[1:]


def _weights(width: int, rows: int, chunks: int, steps: int, together: bool) -> list[float]:
    """Seconds of the W of the 4-layer stack over ``rows`` rows in ``chunks`` micro-batches, one by one or together."""
    from lightning_gpipe.engine.weightgrad import backward_input, run_together

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    times = []
    for _ in range(steps + 1):
        weights = []
        for part in torch.randn(rows, width).chunk(chunks):
            x = part.requires_grad_()
            y = layers(x)
            weights.append(backward_input([y], [torch.ones_like(y)], [x]))
        start = time.perf_counter()
        if together:
            run_together(weights)
        else:
            for weight in weights:
                weight()
        times.append(time.perf_counter() - start)
        layers.zero_grad(set_to_none=True)
    return times[1:]


def _gemms(width: int, steps: int, start_at: float) -> list[float]:
    """Seconds per ``width``-cubed GEMM, timed from the wall-clock moment ``start_at`` (to pair processes)."""
    a, b = torch.randn(width, width), torch.randn(width, width)
    torch.mm(a, b)
    while time.time() < start_at:
        time.sleep(0.001)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return times


def _probe(args) -> None:
    """One measurement in this process: print a JSON line with the median seconds and the run-queue share."""
    torch.set_num_threads(1)
    began, queued = time.perf_counter(), run_queue_wait()
    if args.probe == "micro":
        times = _micro_batched(args.width, args.rows, args.chunk, args.steps)
    elif args.probe in ("weights", "together"):
        times = _weights(args.width, args.rows, args.chunk, args.steps, args.probe == "together")
    else:
        times = _gemms(args.width, args.steps, args.start_at)
    waited = (run_queue_wait() - queued) / (time.perf_counter() - began)
    print(json.dumps({"median_s": statistics.median(times), "runq_wait": waited}))


def _launch(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv], env=clean_env(), stdout=subprocess.PIPE, text=True
    )


def _collect(processes: list[subprocess.Popen]) -> list[dict]:
    records = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode != 0:
            sys.exit(f"a probe failed with exit code {process.returncode}")
        records.append(json.loads(out.strip().splitlines()[-1]))
    return records


def micro(args, chunks: int, probe: str = "micro") -> dict:
    """One probe in a fresh process: ``args.rows`` rows of ``args.width`` features in ``chunks`` micro-batches
    (``probe``: ``"micro"`` forward and backward, ``"weights"``/``"together"`` the W one by one or together)."""
    argv = ["--probe", probe, f"--width={args.width}", f"--rows={args.rows}", f"--chunk={chunks}"]
    return _collect([_launch([*argv, f"--steps={args.steps}"])])[0]


def paired(args, processes: int) -> dict:
    """The slowest of ``processes`` GEMM probes started together (the figure a pipeline's stages share)."""
    start_at = time.time() + 2.0  # every process has imported torch by then
    argv = ["--probe", "gemm", f"--width={args.width}", f"--steps={args.gemms}", f"--start-at={start_at}"]
    records = _collect([_launch(argv) for _ in range(processes)])
    return max(records, key=lambda r: r["median_s"])


def _report(label: str, series: dict[str, list[dict]], numerator: str, denominator: str) -> None:
    num = statistics.median(r["median_s"] for r in series[numerator])
    den = statistics.median(r["median_s"] for r in series[denominator])
    per = ", ".join(f"{a['median_s'] / b['median_s']:.2f}" for a, b in zip(series[numerator], series[denominator]))
    print(f"{label}: {num * 1e3:.1f} / {den * 1e3:.1f} ms = {num / den:.2f}x  (per repeat: {per})")


def _drive(args) -> None:
    configs = {f"M={m}": (lambda m=m: micro(args, m)) for m in (1, *args.chunks)}
    configs |= {"GEMM alone": lambda: paired(args, 1), "GEMM paired": lambda: paired(args, 2)}
    for m in args.chunks:
        configs |= {f"W 1by1 M={m}": lambda m=m: micro(args, m, "weights")}
        configs |= {f"W tog. M={m}": lambda m=m: micro(args, m, "together")}
    series: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, measure in configs.items():
            series[name].append(measure())
    print(f"# {' '.join(sys.argv)}  (torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread per process)")
    for name, records in series.items():
        cells = "  ".join(f"{r['median_s'] * 1e3:8.2f}{'*' if r['runq_wait'] > 0.1 else ' '}" for r in records)
        print(f"{name:12s} {cells}  ms")
    print("* the process waited for a CPU more than 10% of the time\n")
    for m in args.chunks:
        _report(f"micro-batching, {m} x {args.rows // m} rows over 1 x {args.rows}", series, f"M={m}", "M=1")
    _report("two processes side by side, GEMM paired over alone", series, "GEMM paired", "GEMM alone")
    for m in args.chunks:
        _report(f"W of {m} micro-batches, together over one by one", series, f"W tog. M={m}", f"W 1by1 M={m}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024, help="features of each Linear, and the GEMMs' size")
    parser.add_argument("--rows", type=int, default=1024, help="rows of the mini-batch")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16], help="micro-batch counts to compare")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="forward+backward passes per micro-batching probe")
    parser.add_argument("--gemms", type=int, default=40, help="GEMMs per pairing probe")
    parser.add_argument("--probe", choices=["micro", "gemm", "weights", "together"], help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        _probe(args)
    else:
        _drive(args)


if __name__ == "__main__":
    main()
