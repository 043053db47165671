"""Shared fixtures: running a distributed worker script as K stage processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def run_worker(script: str, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>``; Lightning's launcher starts the other stage processes from it."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, str(WORKERS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
    )


@pytest.fixture(scope="session")
def reference_state():
    """State dict of TupleNet after single-device plain Lightning training (the ground truth)."""
    from models import fit

    return fit().state_dict()
