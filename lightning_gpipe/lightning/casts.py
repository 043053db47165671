"""Autocast's casts of the weights, made once per step instead of once per micro-batch.

Under ``precision="bf16-mixed"`` or ``"16-mixed"`` every floating-point weight a layer uses is cast to the lower
precision where the layer runs. torch's autocast keeps the cast of a leaf tensor that requires grad (a weight) for
the rest of the outermost autocast region, so a plain PyTorch loop that runs M micro-batches inside one region
casts each weight once per step. Lightning 2.6 turns that cache off (``MixedPrecision.autocast_context_manager``
passes ``cache_enabled=False``, a workaround for torch's cache losing gradients after a ``no_grad`` forward,
Lightning-AI/pytorch-lightning#20644), which costs nothing where a step calls each layer once; a pipeline calls
each layer once per micro-batch, so every weight was cast M times per step, and each micro-batch's graph kept its
own low-precision copy of every weight until its backward (the figures: docs/benchmarks.md, "Host synchronisations
and casts").

:func:`step_casts_cached` turns the cache back on for the regions of a pipeline step (the strategy's precision
plugin enters it with its step context, :class:`~lightning_gpipe.lightning.optimization.PipelinePrecision`), where
the installed torch keeps gradients through a cast first made under ``no_grad`` (pytorch/pytorch#165068, which
re-materialized micro-batches and users' own ``no_grad`` forwards need): :func:`cache_keeps_gradients` checks that
once per process, on the CPU. The values and gradients are the same as without the cache: the cast is computed once
and shared by the micro-batches' graphs, each of which backpropagates through it into the weight's ``.grad``.
"""

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch


@functools.cache
def cache_keeps_gradients() -> bool:
    """Whether the installed torch's autocast cache keeps a weight's gradient when the weight was first cast under
    ``no_grad`` (true from pytorch/pytorch#165068 on). Checked once per process with a 2 x 2 ``Linear`` under CPU
    autocast (the cache's code is the same for every device)."""
    with torch.inference_mode(False), torch.enable_grad():
        layer = torch.nn.Linear(2, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            with torch.no_grad():
                layer(torch.ones(1, 2))
            return layer(torch.ones(1, 2)).requires_grad


@contextmanager
def step_casts_cached() -> Iterator[None]:
    """Keep autocast's casts of the weights inside this region until the enclosing autocast region ends (for a
    pipeline step: the precision plugin's step context), where :func:`cache_keeps_gradients`; else change nothing.

    The region must not change a weight in place between two uses of it: a cached cast would not see the change
    (torch's own default, as in a plain loop under ``torch.autocast``).
    """
    if not cache_keeps_gradients():
        yield
        return
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)
