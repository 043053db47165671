"""Images per second of one AmoebaNet-D (6, 16) training pass on one CPU thread, by micro-batch size and memory format.

A pipeline stage on this machine is one process with one thread, and it runs its layers on one micro-batch at a
time, so the micro-batch size (batch size / chunks) decides how well the CPU is used: small micro-batches spend
the time on per-operator overhead. This measures the whole network's forward and backward (the example's
module, cross-entropy, random 32 x 32 images), in one process with ``torch.set_num_threads(1)``, for each
micro-batch size, in the default (``contiguous``) and ``channels_last`` memory formats. Configurations are
interleaved (every size and format once, then again, ...) and the median of the repeats is reported, with the
ratio of each size's images/s to the smallest size's.

Usage::

    python benchmarks/amoebanet_microbatch.py                      # sizes 4 8 16 32 64 128, 3 repeats
    python benchmarks/amoebanet_microbatch.py --sizes 8 32 --repeats 5 --formats contiguous
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import models  # noqa: E402

FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


def images_per_second(module: torch.nn.Module, size: int, memory_format: torch.memory_format, passes: int) -> float:
    """Images/s of ``passes`` forward + backward passes of ``module.backbone`` on batches of ``size`` images (after
    one unmeasured pass)."""
    images, labels = models.image_batch(size)
    images = images.contiguous(memory_format=memory_format)
    module.backbone.to(memory_format=memory_format)
    times = []
    for _ in range(passes + 1):
        started = time.perf_counter()
        F.cross_entropy(module.backbone(images), labels).backward()
        times.append(time.perf_counter() - started)
    return size / statistics.median(times[1:])


def main() -> None:
    """Run the interleaved measurements and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128], help="micro-batch sizes")
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), default=list(FORMATS))
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    parser.add_argument("--images", type=int, default=256, help="images per measurement, at least 3 passes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = models.amoebanet_classifier()
    print(f"python benchmarks/amoebanet_microbatch.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; torch {torch.__version__}")
    results: dict[tuple[str, int], list[float]] = {(f, s): [] for f in args.formats for s in args.sizes}
    for repeat in range(args.repeats):
        for memory_format in args.formats:
            for size in args.sizes:
                rate = images_per_second(module, size, FORMATS[memory_format], max(3, args.images // size))
                results[memory_format, size].append(rate)
                line = f"repeat {repeat + 1}  {memory_format:<13} micro-batch {size:>4}: {rate:7.1f} images/s"
                print(line, flush=True)
    print()
    print(f"{'format':<13} {'micro-batch':>11} {'images/s (median)':>18} {'vs smallest':>12}   repeats")
    for memory_format in args.formats:
        base = statistics.median(results[memory_format, args.sizes[0]])
        for size in args.sizes:
            rates = results[memory_format, size]
            median = statistics.median(rates)
            cells = ", ".join(f"{rate:.1f}" for rate in rates)
            print(f"{memory_format:<13} {size:>11} {median:>18.1f} {median / base:>11.2f}x   {cells}")
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
