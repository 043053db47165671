"""Autocast's casts of the weights under mixed precision: once per step, not once per micro-batch, and the same
training as with a cast per micro-batch (lightning_gpipe/lightning/step.py)."""

import collections

import lightning as L
import pytest
import torch
from models import fit
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.lightning import step


class _WeightCasts(TorchDispatchMode):
    """Counts the casts of each parameter to a lower precision."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
            if kwargs.get("dtype") in (torch.bfloat16, torch.float16):
                self.counts[id(args[0])] += 1
        return func(*args, **kwargs)


class _CountStep(L.Callback):
    """The weight casts of one steady-state training step (the third)."""

    def __init__(self) -> None:
        self.mode = _WeightCasts()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 2:
            self.mode.__enter__()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == 2:
            self.mode.__exit__(None, None, None)


def _fit(schedule: str, checkpoint: str) -> tuple:
    counter = _CountStep()
    strategy = GPipeStrategy(chunks=4, schedule=schedule, checkpoint=checkpoint)
    module = fit(strategy, max_steps=3, precision="bf16-mixed", callbacks=[counter])
    return module.state_dict(), counter.mode.counts


# casts of the most-cast weight per step, with the cache and without: fill-drain with re-materialization has two
# autocast regions per step (training_step's fill, backward's drain with its recomputes); re-materialization recomputes
# M - 1 of M micro-batches ("except_last") or all M ("always")
@pytest.mark.parametrize(
    "schedule, checkpoint, cached, uncached",
    [("gpipe", "never", 1, 4), ("gpipe", "except_last", 2, 7), ("1f1b", "never", 1, 4), ("zb-h1", "always", 1, 8)],
)
def test_each_weight_is_cast_once_per_region_and_trains_as_when_cast_per_use(
    schedule, checkpoint, cached, uncached, monkeypatch
):
    assert step.cache_keeps_gradients()  # the torch this package needs (pytorch/pytorch#165068)
    state, counts = _fit(schedule, checkpoint)
    assert max(counts.values()) == cached, counts
    monkeypatch.setattr(step, "cache_keeps_gradients", lambda: False)  # Lightning's own: a cast per use
    uncached_state, counts = _fit(schedule, checkpoint)
    assert max(counts.values()) == uncached, counts
    for name, value in state.items():
        assert torch.equal(value, uncached_state[name]), name
