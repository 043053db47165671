"""A failure on one stage ends every process within 60 s, naming the stage and the original error."""

import time

import pytest
import torch
from conftest import run_worker
from models import TupleNet, fit

CASES = {
    "loss": ["stage 1 failed with ValueError: boom in the loss", "stage 0 stopped because stage 1 failed"],
    "validation": ["stage 1 failed with ValueError: boom in validation", "stage 0 stopped because stage 1 failed"],
    "layer": [
        "Backbone layer 1 (ReturnsList) returned a list of (Tensor, Tensor, Tensor); layers of a pipelined backbone"
        " must return a Tensor or a tuple of Tensors",
        "stage 1 stopped because stage 0 failed with TypeError",
    ],
    "before_backbone": [
        "`self.head` was called on stage 0, before the backbone call",
        "stage 1 stopped because stage 0 failed with RuntimeError",
    ],
    "balance": ["[rank0]: ValueError: balance=[1, 1] sums to 2 but the backbone has 8 layers."],
    "manual": ["RuntimeError: GPipeStrategy supports automatic optimization only"],
}


def _exits(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
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


def _assert_every_stage_exits(out):
    for rank in range(2):
        pid, started = (out / f"rank{rank}.txt").read_text().split()
        assert _exits(int(pid), within=60 - (time.time() - float(started)))


@pytest.mark.parametrize("case", CASES)
def test_failure_ends_every_stage(case, tmp_path):
    result = run_worker("failure.py", case, str(tmp_path), timeout=180)
    assert result.returncode != 0
    for message in CASES[case]:
        assert message in result.stderr, result.stderr[-3000:]
    _assert_every_stage_exits(tmp_path)


def test_killed_stage_ends_every_process_and_the_last_checkpoint_resumes(tmp_path, reference_state):
    result = run_worker("failure.py", "kill", str(tmp_path), timeout=180)
    assert result.returncode != 0
    # Lightning's launcher watches the stage processes it started and ends the job naming the killed one
    assert "terminated with code -9" in result.stderr, result.stderr[-3000:]
    _assert_every_stage_exits(tmp_path)
    loaded = TupleNet.load_from_checkpoint(tmp_path / "good.ckpt").state_dict()
    for key, expected in fit(max_steps=3).state_dict().items():
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=1e-5)
    result = run_worker("failure.py", "resume", str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = torch.load(tmp_path / "resumed.pt")
    for key, expected in reference_state.items():
        torch.testing.assert_close(resumed[key], expected, rtol=0, atol=1e-5)
