"""The planner's measurements: a backbone's layers at two micro-batch sizes, and a module's optimizer state."""

from typing import Any

import torch
from torch import nn

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.microbatch import Value
from lightning_gpipe.planning.balance.profile import profile_layers
from lightning_gpipe.planning.costs import ProfiledCosts, optimizer_state_factor
from lightning_gpipe.planning.search import MAX_CHUNKS

PROFILED_CHUNKS = 8
"""The larger profiled micro-batch is one of this many (times for fewer micro-batches are extrapolated)."""


def profile_sizes(
    layers: nn.Sequential,
    value: Value,
    device: torch.device | str,
    chunks: int | None = None,
    split: bool = False,
) -> ProfiledCosts:
    """Profile ``layers`` (:func:`~lightning_gpipe.planning.balance.profile_layers`; with ``split``, the B/W split timed
    too, for a named schedule that splits its backwards, :attr:`~lightning_gpipe.planning.search.Constraints.splits`) on
    two micro-batches of the mini-batch ``value``: one of :data:`PROFILED_CHUNKS` and one of
    :data:`~lightning_gpipe.planning.search.MAX_CHUNKS` (or, when ``chunks`` is fixed, one of ``chunks`` micro-batches,
    twice the same size). Not the whole mini-batch: a layer's activations on all of it may not fit a device that
    trains the model in micro-batches.

    Raises:
        TypeError, ValueError: as :func:`~lightning_gpipe.engine.microbatch.batch_size` and
            :func:`~lightning_gpipe.planning.balance.profile_layers`.
    """
    rows = microbatch.batch_size(value)
    large_chunks, small_chunks = (chunks, chunks) if chunks is not None else (PROFILED_CHUNKS, MAX_CHUNKS)
    large, small = (microbatch.scatter(value, m)[0] for m in (large_chunks, small_chunks))
    large_costs = profile_layers(layers, large, device, split=split)
    small_costs = large_costs if small_chunks == large_chunks else profile_layers(layers, small, device, split=split)
    sizes = (microbatch.batch_size(large), microbatch.batch_size(small))
    input_bytes = sum(t.numel() * t.element_size() for t in microbatch.tensors(value))
    return ProfiledCosts(sizes, large_costs, small_costs, rows, input_bytes)


def module_state_factor(module: Any) -> int | None:
    """The optimizer state factor (:func:`~lightning_gpipe.planning.costs.optimizer_state_factor`) of the optimizer
    ``module.configure_optimizers()`` returns (the first one); ``None`` if it cannot be called here (it needs the
    trainer, say) or returns no optimizer. The optimizer made is dropped (it holds no state yet)."""
    try:
        configured = module.configure_optimizers()
    except Exception:  # the user's hook may need what only a running Trainer has; the caller says what it assumes
        return None
    optimizer = _first_optimizer(configured)
    return None if optimizer is None else optimizer_state_factor(optimizer)


def _first_optimizer(configured: Any) -> torch.optim.Optimizer | None:
    """The first optimizer in what ``configure_optimizers`` may return (an optimizer, a dict, a list or tuple)."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    return None
