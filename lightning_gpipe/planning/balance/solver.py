"""The optimal contiguous partition of a chain of layers with known costs."""

from collections.abc import Callable, Sequence
from itertools import accumulate

from lightning_gpipe.planning.balance.costs import LayerCost


def solve(
    costs: Sequence[float],
    num_stages: int,
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> list[int]:
    """Split a chain of layers into ``num_stages`` contiguous, non-empty stages minimising the costliest stage.

    A pipeline runs at the pace of its slowest stage, so this is the split that
    GPipe (Huang et al. 2019, section 2.2) and PipeDream (Narayanan et al. 2019,
    section 3.1, profiler-driven partitioning under memory constraints) aim for.
    Solved exactly by dynamic programming in O(num_stages * len(costs)^2) time.

    Args:
        costs: non-negative cost of each layer in order (seconds, bytes, parameter counts...).
        num_stages: K, the number of stages (>= 1).
        memory: non-negative memory of each layer in order (bytes), used with ``memory_limit``.
        memory_limit: the most memory one stage may hold (the sum of its layers' ``memory``);
            ``None`` (default) for no limit. The split is then the best one among those that fit.

    Returns:
        ``balance``: the number of layers of each stage, summing to ``len(costs)``.
        Among optimal splits, the one whose earlier stages are as short as possible.

    Raises:
        ValueError: if there are fewer layers than stages, a cost or memory is negative, only one of
            ``memory`` and ``memory_limit`` is given or their lengths differ, or no split keeps every stage
            within ``memory_limit`` (the message gives the smallest limit that fits).
    """
    _check(costs, num_stages, memory, memory_limit)
    return solve_by_stage([costs] * num_stages, memory, memory_limit)


def solve_by_stage(
    costs: Sequence[Sequence[float]],
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> list[int]:
    """:func:`solve` where a layer costs what the stage it lands on makes it cost: ``costs[k][i]`` is layer ``i``'s
    cost were it on stage ``k`` (a stage that runs its backwards as B and W apart, or one measured slower than
    profiled). Minimises the costliest stage, each stage's cost the sum of its layers' costs there.

    Args:
        costs: one row of non-negative layer costs per stage, all of one length; ``len(costs)`` is K.
        memory: non-negative memory of each layer in order (bytes), used with ``memory_limit``.
        memory_limit: the most memory one stage may hold (the sum of its layers' ``memory``); ``None`` (default)
            for no limit.

    Returns:
        ``balance``, as :func:`solve`'s.

    Raises:
        ValueError: as :func:`solve` (no row is no stage), and for rows of different lengths.
    """
    num_stages, layers = len(costs), len(costs[0]) if costs else 0
    if any(len(row) != layers for row in costs):
        raise ValueError(f"Give every stage one cost per layer; got rows of {sorted({len(row) for row in costs})}.")
    for row in costs or [[]]:  # no row: no stage, which _check refuses
        _check(row, num_stages, memory, memory_limit)
    fits = _fits(memory, memory_limit)
    prefixes = [[0.0, *accumulate(row)] for row in costs]
    # best[k][i]: lowest possible costliest stage when the first i layers form k stages
    best = [[float("inf")] * (layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        prefix = prefixes[k - 1]
        for i in range(k, layers - (num_stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], prefix[i] - prefix[j])
                if candidate < best[k][i] and fits(j, i):
                    best[k][i], cut[k][i] = candidate, j
    if best[num_stages][layers] == float("inf"):
        # without a memory limit every split fits, and there is one (_check): only the limit leaves none
        assert memory is not None and memory_limit is not None
        smallest = max(stage_sums(memory, solve(memory, num_stages)))
        raise ValueError(
            f"No split into {num_stages} stages keeps every stage within the balance's memory limit of"
            f" {memory_limit:,.0f} bytes; the smallest limit that fits is {smallest:,.0f} bytes. Raise the limit, use"
            " more devices, or split the largest layers."
        )
    balance, end = [], layers
    for k in range(num_stages, 0, -1):
        balance.append(end - cut[k][end])
        end = cut[k][end]
    return balance[::-1]


def _check(costs: Sequence[float], num_stages: int, memory: Sequence[float] | None, memory_limit: float | None) -> None:
    """Raise :func:`solve`'s ``ValueError`` for arguments it cannot solve."""
    layers = len(costs)
    if num_stages < 1 or layers < num_stages:
        raise ValueError(f"Cannot split {layers} layers into {num_stages} non-empty stages.")
    if any(cost < 0 for cost in costs):
        raise ValueError("Layer costs must be non-negative.")
    if (memory is None) != (memory_limit is None):
        raise ValueError("Give both `memory` (bytes per layer) and `memory_limit` (bytes per stage), or neither.")
    if memory is not None and (len(memory) != layers or any(size < 0 for size in memory)):
        raise ValueError(f"`memory` needs one non-negative size per layer ({layers}), got {len(memory)} values.")


def _fits(memory: Sequence[float] | None, limit: float | None) -> Callable[[int, int], bool]:
    """Whether the stage of layers ``j`` to ``i - 1`` fits in ``limit``."""
    if memory is None:
        return lambda j, i: True
    assert limit is not None  # _check: both or neither
    prefix = [0.0, *accumulate(memory)]
    return lambda j, i: prefix[i] - prefix[j] <= limit


def stage_sums(costs: Sequence[float | LayerCost], balance: Sequence[int]) -> list[float]:
    """The total cost of each stage of ``balance``, e.g. its time or memory.

    Args:
        costs: cost of each layer in order: numbers (seconds, bytes...), or the :class:`LayerCost` of each layer
            (from :func:`~lightning_gpipe.planning.balance.profile_layers`), which count their time, ``forward +
            backward`` seconds (what ``balance="time"`` evens out). For another measure pass its numbers, e.g.
            ``layer_weights("memory", costs)``.
        balance: layers per stage, summing to ``len(costs)``.

    Raises:
        ValueError: if ``balance`` does not sum to the number of layers.
    """
    if sum(balance) != len(costs):
        raise ValueError(f"balance={list(balance)} sums to {sum(balance)} but there are {len(costs)} layer costs.")
    values = [cost.forward + cost.backward if isinstance(cost, LayerCost) else cost for cost in costs]
    bounds = [0, *accumulate(balance)]
    return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]
