"""Which configurations of a grid the suite runs: a few that cover every mechanism by default, every one on demand.

The suite must stay within minutes on two cores, and a run on 3 or 4 stage processes costs seconds each; a grid of
runs (every schedule x sharding x re-materialization...) is therefore cut to the runs that together meet each
mechanism at least once, and the whole grid runs with ``LIGHTNING_GPIPE_TEST_GRID=full`` in the environment (what
``python benchmarks/full_grid.py`` sets). Both the test modules and the workers they launch read it, so they agree on
what ran.
"""

import os

FULL = os.environ.get("LIGHTNING_GPIPE_TEST_GRID") == "full"
"""Whether every configuration of every grid runs (``LIGHTNING_GPIPE_TEST_GRID=full``), not only the suite's."""


def suite(runs: dict, *kept: str) -> dict:
    """``runs`` (name -> configuration) whole with :data:`FULL`, else only those named in ``kept``, in their order.

    Raises:
        KeyError: for a name in ``kept`` that ``runs`` does not have (a grid renamed under the suite's choice).
    """
    missing = [name for name in kept if name not in runs]
    if missing:
        raise KeyError(f"the suite keeps runs this grid does not have: {missing}")
    return dict(runs) if FULL else {name: value for name, value in runs.items() if name in kept}
