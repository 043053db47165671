"""Choosing ``balance`` from per-layer costs by what a stage should even out: parameters, time or memory;
and checking a ``balance`` the user gave."""

from collections.abc import Sequence

from torch import nn

from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.solver import solve

MODES = ("params", "time", "memory")


def layer_weights(mode: str, costs: Sequence[LayerCost], state_copies: float = 1.0) -> Sequence[float]:
    """What each layer adds to its stage's cost under ``mode``.

    Args:
        mode: ``"params"`` (``parameter_bytes``), ``"time"`` (``forward + backward``, seconds) or
            ``"memory"`` (``activation_bytes + state_copies * parameter_bytes``).
        costs: one :class:`LayerCost` per layer, in order.
        state_copies: for ``"memory"``, the bytes counted per byte of parameters (default 1: the parameters; a
            sharded run counts its state as it holds it, :func:`~lightning_gpipe.planning.predict.state_copies`).

    Raises:
        ValueError: for an unknown ``mode``.
    """
    if mode == "params":
        return [cost.parameter_bytes for cost in costs]
    if mode == "time":
        return [cost.forward + cost.backward for cost in costs]
    if mode == "memory":
        return layer_memory(costs, state_copies)
    raise ValueError(f"Unknown balance mode {mode!r}; choose one of {', '.join(MODES)}.")


def layer_memory(costs: Sequence[LayerCost], state_copies: float = 1.0) -> list[float]:
    """Bytes each layer holds for one micro-batch: its saved activations and ``state_copies`` times its parameters
    (default 1: the parameters once)."""
    return [cost.activation_bytes + state_copies * cost.parameter_bytes for cost in costs]


def balance_by(
    mode: str,
    costs: Sequence[LayerCost],
    num_stages: int,
    memory_limit: int | None = None,
    state_copies: float = 1.0,
) -> list[int]:
    """The contiguous split of the layers into ``num_stages`` stages that minimises the costliest stage under ``mode``.

    PipeDream-style profile-driven partitioning (Narayanan et al. 2019, section 3.1), solved exactly
    by :func:`~lightning_gpipe.planning.balance.solve`.

    Args:
        mode: ``"params"``, ``"time"`` or ``"memory"``, see :func:`layer_weights`.
        costs: one :class:`LayerCost` per layer, in order, e.g. from
            :func:`~lightning_gpipe.planning.balance.profile_layers` or your own measurements.
        num_stages: K, the number of stages.
        memory_limit: bytes one stage may hold, counted as the sum of its layers' ``activation_bytes +
            parameter_bytes`` for one micro-batch; ``None`` (default) for no limit. Leave headroom for
            what this does not count: gradients and optimizer state (a multiple of the parameters), the
            stage-boundary outputs of all micro-batches, and every micro-batch's activations when
            nothing is re-materialized (``checkpoint="never"``).
        state_copies: for ``"memory"``, the bytes counted per byte of parameters (default 1: see
            :func:`layer_weights`); the limit always counts the parameters once.

    Returns:
        ``balance``: the number of layers of each stage.

    Raises:
        ValueError: for an unknown ``mode``, fewer layers than stages, or no split within ``memory_limit``.
    """
    weights = layer_weights(mode, costs, state_copies)
    if memory_limit is None:
        return solve(weights, num_stages)
    return solve(weights, num_stages, memory=layer_memory(costs), memory_limit=memory_limit)


def resolve_balance(
    balance: None | str | Sequence[int],
    layers: nn.Sequential,
    num_stages: int,
    costs: Sequence[LayerCost] | None = None,
    memory_limit: int | None = None,
    virtual_stages: int = 1,
    state_copies: float = 1.0,
) -> list[int]:
    """Check a user's ``balance`` against the backbone, or choose the split that evens out a cost.

    Args:
        balance: layers per stage; or ``"params"``, ``"time"`` or ``"memory"`` for the contiguous split
            whose costliest stage is cheapest by that measure (see :func:`balance_by`);
            ``None`` means ``"params"``.
        layers: the backbone.
        num_stages: the number of stages: K, the devices of one pipeline, times ``virtual_stages``.
        costs: the profiled :class:`LayerCost` of each layer; needed for
            ``"time"``, ``"memory"`` and ``memory_limit``. Without it ``"params"`` counts parameters.
        memory_limit: bytes one stage may hold (see :func:`balance_by`), or ``None``.
        virtual_stages: the model chunks per device (default 1), for the error messages.
        state_copies: for ``"memory"``, the bytes counted per byte of parameters (see :func:`layer_weights`).

    Raises:
        ValueError: if the lengths or the sum do not match, a stage is empty, there are fewer layers than
            stages, ``costs`` are missing or of another length, or no split fits ``memory_limit``.
    """
    count = len(layers)
    if balance is None or isinstance(balance, str):
        if count < num_stages:
            stages = "stages (devices)" if virtual_stages == 1 else f"virtual stages (virtual_stages={virtual_stages})"
            fewer = "devices" if virtual_stages == 1 else "devices or virtual stages"
            raise ValueError(
                f"The backbone has {count} layers, fewer than the {num_stages} {stages}; use fewer {fewer} or split"
                " the backbone into more layers."
            )
        mode = balance or "params"
        if costs is None and mode == "params" and memory_limit is None:
            return solve([sum(p.numel() for p in layer.parameters()) for layer in layers], num_stages)
        if costs is None or len(costs) != count:
            raise ValueError(
                f"balance={mode!r} needs the profiled cost of each of the {count} backbone layers, got"
                f" {'none' if costs is None else len(costs)}; measure them with `lightning_gpipe.profile_layers`."
            )
        return balance_by(mode, costs, num_stages, memory_limit, state_copies)
    balance = list(balance)
    if len(balance) != num_stages:
        raise ValueError(
            f"balance={balance} has {len(balance)} stages but the pipeline has {num_stages} devices; give one"
            " layer count per device."
        )
    if any(size < 1 for size in balance):
        raise ValueError(f"balance={balance} leaves a stage empty; every stage needs at least one layer.")
    if sum(balance) != count:
        raise ValueError(f"balance={balance} sums to {sum(balance)} but the backbone has {count} layers.")
    return balance
