"""Shared fixtures: running a distributed worker script as K stage processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKERS = Path(__file__).parent / "workers"


def run_worker(script: str, *args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<script>``; Lightning's launcher starts the other stage processes from it."""
    process = start_worker(script, *args, env=env)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def start_worker(script: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start ``tests/workers/<script>`` (the main process of its stages) and return at once."""
    environment = {
        k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    environment.update(env or {})
    return subprocess.Popen(
        [sys.executable, str(WORKERS / script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )


def process_exits(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
    import time

    deadline = time.time() + within
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="session")
def reference_state():
    """State dict of TupleNet after single-device plain Lightning training (the ground truth)."""
    from models import fit

    return fit().state_dict()


def one_stage_pipeline(module, chunks: int, checkpoint: str, defer_weight_grad: bool = False):
    """Split ``module.backbone`` into a one-stage pipeline in this process.

    Calling ``module.backbone`` then runs the fill (straight through the schedule: there is no user step around
    the calls here); the returned :class:`~lightning_gpipe.schedule.GPipe` schedule's ``backward()`` runs the
    drain, and its ``stage.events`` records the spans.
    """
    import torch

    from lightning_gpipe.partition import Split
    from lightning_gpipe.schedule import GPipe
    from lightning_gpipe.stage import Stage
    from lightning_gpipe.transfer import Link

    split = Split(module, "backbone", [len(module.backbone)], stage_index=0)
    stage = Stage(split.partition, Link(None, None, torch.device("cpu")), 0, 1, chunks, checkpoint, defer_weight_grad)
    schedule = GPipe(stage)
    split.partition.pipeline = _ThroughSchedule(schedule)
    return schedule


class _ThroughSchedule:
    """A :class:`~lightning_gpipe.partition.PipelinedCall` that runs the schedule's forward on every call."""

    def __init__(self, schedule) -> None:
        self.schedule = schedule

    def __call__(self, value):
        return self.schedule.forward(value)

    def forward_and_share(self, value, fn):
        return fn(self.schedule.forward(value))


def assert_states_close(state: dict, expected: dict, atol: float = 1e-5, rtol: float = 0.0) -> None:
    """Assert two state dicts have the same keys and every entry is close (fp32 default: 1e-5 absolute)."""
    import torch

    assert state.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(state[key], expected[key], atol=atol, rtol=rtol, msg=key)
