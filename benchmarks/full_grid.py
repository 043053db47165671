"""The test suite's distributed tests with every configuration of their grids (``LIGHTNING_GPIPE_TEST_GRID=full``).

The suite (``python -m pytest``) runs, of each grid of equality runs (schedules x sharding x re-materialization x
checkpoints on 3 and 4 stage processes...), the few that meet every mechanism once, to stay within minutes on two
cores (tests/grid.py). This runs them all: about three times the suite's distributed part on a 2-core machine.

Usage: python benchmarks/full_grid.py [PYTEST ARGUMENTS]  (default: tests/distributed)
"""

import os
import sys

import pytest

if __name__ == "__main__":
    os.environ["LIGHTNING_GPIPE_TEST_GRID"] = "full"
    sys.exit(pytest.main(sys.argv[1:] or ["tests/distributed"]))
