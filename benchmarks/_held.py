"""What one process holds during a Lightning fit, for the memory benchmarks (``sharding.py``, ``tensor_parallel.py``).

:class:`Measure`, a callback, records at the last step's ``on_before_optimizer_step`` (parameters, gradients and the
optimizer's state all exist then) the bytes of the tensors the process holds (a ``DTensor``'s local shard), its
resident set's peak during the fit over its size before the model was built, and how many times each collective that
:func:`count_calls` wrapped ran in the last step. Byte counts do not depend on the machine's load.

Import as ``_held`` from a script in ``benchmarks/``.
"""

import gc
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

COUNTS: dict[str, int] = {}
"""Calls so far of each function :func:`count_calls` wrapped, by its name."""


def count_calls(owner: Any, name: str) -> None:
    """Replace the function ``owner.name`` (e.g. ``torch.distributed.all_gather_single``) in ``owner`` by one that
    counts its calls in :data:`COUNTS` under ``name``; callers that look it up in ``owner`` when they call it (as
    ``dist.all_gather_single(...)`` does) are counted, on every thread."""
    function: Callable = getattr(owner, name)
    COUNTS[name] = 0

    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return function(*args, **kwargs)

    setattr(owner, name, counted)


def local_bytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` takes in this process: a ``DTensor``'s local shard, else the whole tensor."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) / 1024


class Measure(pl.Callback):
    """What one process holds and peaks at during one fit (see the module docstring).

    After the fit: ``parameters`` (bytes of the parameters), ``state`` (bytes of the parameters, their gradients and
    the optimizer's tensor states; DDP's gradient buckets, a second copy of the gradients, are not counted), ``peak``
    (MiB: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``, over ``VmRSS`` before the model was built)
    and ``collectives`` (calls in the last step of each function :func:`count_calls` wrapped, by name).
    """

    def setup(self, trainer, pl_module, stage) -> None:
        gc.collect()  # the last fit's module, optimizer and trainer, held in reference cycles
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.start = _status_mib("VmRSS")

    def on_train_batch_start(self, *_) -> None:
        self.counts = dict(COUNTS)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        parameters = list(pl_module.parameters())
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
        self.parameters = sum(local_bytes(p) for p in parameters)
        gradients = sum(local_bytes(p.grad) for p in parameters if p.grad is not None)
        self.state = self.parameters + gradients + sum(local_bytes(t) for t in states)

    def on_train_batch_end(self, *_) -> None:
        self.collectives = {name: COUNTS[name] - self.counts[name] for name in COUNTS}

    def on_train_end(self, trainer, pl_module) -> None:
        self.peak = _status_mib("VmHWM") - self.start
