"""How many times the profile times a layer: until the times settle, within a cap.

One timed run of a layer may fall on a moment the core served another process, a cold cache or the allocator's first
use of a size; the median of a fixed few runs is still noisy on a busy machine, and wasted where the first runs agree.
:class:`Repeats` times at least ``least`` runs, then more until their interquartile range is within ``spread`` of their
median (:func:`relative_spread`), or ``most`` runs, or ``budget`` seconds of timed runs, whichever comes first. It waits
for nothing: every run it asks for is a measurement.
"""

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


def relative_spread(seconds: Sequence[float]) -> float:
    """The interquartile range of ``seconds`` over their median (``statistics.quantiles``, inclusive): 0 for fewer
    than two; ``math.inf`` for a median of 0 with a range above it."""
    if len(seconds) < 2:
        return 0.0
    first, median, third = statistics.quantiles(seconds, n=4, method="inclusive")
    if median <= 0:
        return 0.0 if third <= first else math.inf
    return (third - first) / median


@dataclass(frozen=True)
class Repeats:
    """When the profile has timed a layer enough (see the module docstring).

    Args:
        least: timed runs at least (default 5).
        most: timed runs at most (default 40).
        spread: the largest interquartile range, as a share of the median, at which the runs count as settled
            (default 0.05).
        budget: seconds of timed runs after which no more are taken, settled or not (default 2.0: a layer whose run
            takes 0.4 s or more is timed ``least`` times).

    Raises:
        ValueError: for ``least < 1``, ``most < least``, a negative ``spread`` or a ``budget`` not above 0.
    """

    least: int = 5
    most: int = 40
    spread: float = 0.05
    budget: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.least <= self.most or self.spread < 0 or self.budget <= 0:
            raise ValueError(
                f"Repeats(least={self.least}, most={self.most}, spread={self.spread}, budget={self.budget}): give"
                " 1 <= least <= most timed runs, a spread >= 0 and a budget above 0 seconds."
            )

    @classmethod
    def exactly(cls, runs: int) -> "Repeats":
        """``runs`` timed runs, however they spread.

        Raises:
            ValueError: for ``runs < 1``.
        """
        return cls(least=runs, most=runs)

    def enough(self, seconds: Sequence[float]) -> bool:
        """Whether runs that took ``seconds`` each are enough: at least ``least``, and ``most``, or ``budget`` seconds
        in all, or settled within ``spread``."""
        if len(seconds) < self.least:
            return False
        return len(seconds) >= self.most or sum(seconds) >= self.budget or relative_spread(seconds) <= self.spread

    def collect(self, run: Callable[[], T], seconds: Callable[[T], float]) -> list[T]:
        """Call ``run`` until :meth:`enough` of its results' ``seconds``; the results, in order."""
        results: list[T] = []
        times: list[float] = []
        while not self.enough(times):
            results.append(run())
            times.append(seconds(results[-1]))
        return results
