"""Choosing ``balance`` from per-layer costs by what a stage should even out: parameters, time or memory."""

from collections.abc import Sequence
from typing import Optional

from lightning_gpipe.balance.costs import LayerCost
from lightning_gpipe.balance.solver import solve

MODES = ("params", "time", "memory")


def layer_weights(mode: str, costs: Sequence[LayerCost]) -> list[float]:
    """What each layer adds to its stage's cost under ``mode``.

    Args:
        mode: ``"params"`` (``parameter_bytes``), ``"time"`` (``forward + backward``, seconds) or
            ``"memory"`` (``activation_bytes + parameter_bytes``).
        costs: one :class:`LayerCost` per layer, in order.

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode == "params":
        return [cost.parameter_bytes for cost in costs]
    if mode == "time":
        return [cost.forward + cost.backward for cost in costs]
    if mode == "memory":
        return layer_memory(costs)
    raise ValueError(f"Unknown balance mode {mode!r}; choose one of {', '.join(MODES)}.")


def layer_memory(costs: Sequence[LayerCost]) -> list[int]:
    """Bytes each layer holds for one micro-batch: its saved activations and its parameters."""
    return [cost.activation_bytes + cost.parameter_bytes for cost in costs]


def balance_by(mode: str, costs: Sequence[LayerCost], num_stages: int, memory_limit: Optional[int] = None) -> list[int]:
    """The contiguous split of the layers into ``num_stages`` stages that minimises the costliest stage under ``mode``.

    PipeDream-style profile-driven partitioning (Narayanan et al. 2019, section 3.1), solved exactly
    by :func:`~lightning_gpipe.balance.solve`.

    Args:
        mode: ``"params"``, ``"time"`` or ``"memory"``, see :func:`layer_weights`.
        costs: one :class:`LayerCost` per layer, in order, e.g. from
            :func:`~lightning_gpipe.balance.profile_layers` or your own measurements.
        num_stages: K, the number of stages.
        memory_limit: bytes one stage may hold, counted as the sum of its layers' ``activation_bytes +
            parameter_bytes`` for one micro-batch; ``None`` (default) for no limit. Leave headroom for
            what this does not count: gradients and optimizer state (a multiple of the parameters), the
            stage-boundary outputs of all micro-batches, and every micro-batch's activations when
            nothing is re-materialized (``checkpoint="never"``).

    Returns:
        ``balance``: the number of layers of each stage.

    Raises:
        ValueError: for an unknown ``mode``, fewer layers than stages, or no split within ``memory_limit``.
    """
    weights = layer_weights(mode, costs)
    if memory_limit is None:
        return solve(weights, num_stages)
    return solve(weights, num_stages, memory=layer_memory(costs), memory_limit=memory_limit)
