"""The optimal contiguous partition of a chain of layers with known costs."""

from collections.abc import Sequence
from itertools import accumulate


def solve(costs: Sequence[float], num_stages: int) -> list[int]:
    """Split a chain of layers into ``num_stages`` contiguous, non-empty stages minimising the costliest stage.

    A pipeline runs at the pace of its slowest stage, so this is the split that
    GPipe (Huang et al. 2019, section 2.2) and PipeDream (Narayanan et al. 2019,
    section 3.1) aim for. Solved exactly by dynamic programming in
    O(num_stages * len(costs)^2) time.

    Args:
        costs: non-negative cost of each layer in order (seconds, bytes, parameter counts...).
        num_stages: K, the number of stages (>= 1).

    Returns:
        ``balance``: the number of layers of each stage, summing to ``len(costs)``.
        Among optimal splits, the one whose earlier stages are as short as possible.

    Raises:
        ValueError: if there are fewer layers than stages, or a cost is negative.
    """
    layers = len(costs)
    if num_stages < 1 or layers < num_stages:
        raise ValueError(f"Cannot split {layers} layers into {num_stages} non-empty stages.")
    if any(cost < 0 for cost in costs):
        raise ValueError("Layer costs must be non-negative.")
    prefix = [0.0, *accumulate(costs)]
    # best[k][i]: lowest possible costliest stage when the first i layers form k stages
    best = [[float("inf")] * (layers + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, layers - (num_stages - k) + 1):
            for j in range(k - 1, i):
                candidate = max(best[k - 1][j], prefix[i] - prefix[j])
                if candidate < best[k][i]:
                    best[k][i], cut[k][i] = candidate, j
    balance, end = [], layers
    for k in range(num_stages, 0, -1):
        balance.append(end - cut[k][end])
        end = cut[k][end]
    return balance[::-1]
