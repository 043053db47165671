"""Activation offload on one GPU: peak device memory and step time with and without ``offload="activations"``.

A one-stage pipeline (K = 1, the engine's ``StagePipeline``, no Lightning) of an MLP of ``--layers`` blocks
``Linear(width, width) + ReLU``, fill-drain over ``--chunks`` micro-batches, ``checkpoint="never"`` (a re-materialized
micro-batch saves nothing to offload), fp32, SGD. With offload every micro-batch but the last moves what its forward
saved to pinned host memory on a side stream, and comes back one backward ahead (docs/training.md, "Activation
offload"). Each measurement builds the model afresh (the same seed), runs ``--warmup`` steps, then ``--steps`` steps
timed with the device synchronised at each step's end, the peak of ``torch.cuda.max_memory_allocated`` over them;
the two configurations alternate for ``--repeats`` interleaved repeats. Prints each repeat, the medians, the ratios
(offload over none) and the largest gradient difference of the first step between the two (0: offload changes no
value), and how many saved tensors came back late (unpacked before their prefetch: 0 when the schedule's prefetches
cover them).

Usage::

    python benchmarks/offload_gpu.py                         # width 4096, 8 layers, batch 8192, 8 micro-batches
    python benchmarks/offload_gpu.py --width 8192 --batch 16384

On a machine without CUDA it says it needs a GPU and exits 0: on a CPU offload moves nothing anywhere useful.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_gpipe.engine import StageSpec, Topology, build_pipeline  # noqa: E402
from lightning_gpipe.faults import Job  # noqa: E402

CONFIGS = {"none": None, "activations": "activations"}
"""The offload values compared, by the name printed."""


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, offload: str | None, device: torch.device) -> dict:
    """One measurement: median step seconds, peak allocated bytes over the timed steps, the parameters' bytes, the
    first step's gradients (on the host) and the saved tensors unpacked before their prefetch."""
    torch.manual_seed(0)
    module = nn.Module()
    module.backbone = nn.Sequential(
        *[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)]
    )
    module.to(device)
    spec = StageSpec(
        Topology(1, 1), 0, device, balance=[args.layers], micro_batches=args.chunks, checkpoint="never", offload=offload
    )
    pipeline = build_pipeline(module, "backbone", spec, Job())
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3)
    x = torch.randn(args.batch, args.width, device=device, generator=torch.Generator(device).manual_seed(1))
    times, first, late = [], None, 0

    def step() -> None:
        y = pipeline.forward(x)
        assert y is not None  # a one-stage pipeline's stage is the last
        y.float().pow(2).mean().backward()
        pipeline.backward()

    for number in range(args.warmup + args.steps):
        if number == args.warmup:
            _synchronize(device)
            _reset_peak(device)
        start = time.perf_counter()
        step()
        if first is None:
            first = [p.grad.detach().to("cpu", copy=True) for p in module.parameters()]
        late += sum(chunk.offload.late for chunk in pipeline._model_chunks if chunk.offload is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        if number >= args.warmup:
            times.append(time.perf_counter() - start)
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "time": statistics.median(times),
        "peak": _peak(device),
        "parameters": parameters,
        "grads": first,
        "late": late,
    }


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    if not torch.cuda.is_available():
        print(
            "offload_gpu.py needs a GPU: on a CPU offload moves nothing anywhere useful (activations stay in host"
            " memory)."
        )
        return
    device = torch.device("cuda", 0)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; {vars(args)}")
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for name, offload in CONFIGS.items():
            result = measure(args, offload, device)
            runs[name].append(result)
            print(
                f"repeat {repeat} {name:>11}: {result['time'] * 1e3:8.1f} ms/step,"
                f" peak {result['peak'] / 2**20:8.0f} MiB"
                f" (parameters {result['parameters'] / 2**20:.0f} MiB), late unpacks {result['late']}"
            )
            torch.cuda.empty_cache()
    time_of = {name: statistics.median(r["time"] for r in results) for name, results in runs.items()}
    peak_of = {name: statistics.median(r["peak"] for r in results) for name, results in runs.items()}
    above = {name: peak_of[name] - runs[name][0]["parameters"] for name in runs}
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(runs["activations"][0]["grads"], runs["none"][0]["grads"], strict=True)
    )
    for name in runs:
        print(f"median {name:>11}: {time_of[name] * 1e3:8.1f} ms/step, peak {peak_of[name] / 2**20:8.0f} MiB")
    print(
        f"offload / none: peak {peak_of['activations'] / peak_of['none']:.3f}x, peak above the parameters"
        f" {above['activations'] / above['none']:.3f}x, step time {time_of['activations'] / time_of['none']:.3f}x;"
        f" largest gradient difference of the first step {difference:.3g}"
    )


if __name__ == "__main__":
    main()
