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


def one_stage_pipeline(module, chunks: int, checkpoint: str):
    """Split ``module.backbone`` into a one-stage pipeline in this process.

    Calling ``module.backbone`` then runs the fill; the returned :class:`~lightning_gpipe.schedule.GPipe`
    schedule's ``backward()`` runs the drain, and its ``stage.events`` records the spans.
    """
    import torch

    from lightning_gpipe.contract import BackboneCall
    from lightning_gpipe.partition import Split
    from lightning_gpipe.schedule import GPipe
    from lightning_gpipe.stage import Stage
    from lightning_gpipe.transfer import Link

    split = Split(module, "backbone", [len(module.backbone)], stage_index=0)
    stage = Stage(split.partition, Link(None, None, torch.device("cpu")), 0, 1, chunks, checkpoint)
    schedule = GPipe(stage)
    split.partition.pipeline = BackboneCall(schedule, is_last=True)
    return schedule
