"""A failure on one stage ends every process within 60 s, naming the stage and the original error."""

import time

import pytest
from conftest import run_worker

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


@pytest.mark.parametrize("case", CASES)
def test_failure_ends_every_stage(case, tmp_path):
    result = run_worker("failure.py", case, str(tmp_path), timeout=180)
    assert result.returncode != 0
    for message in CASES[case]:
        assert message in result.stderr, result.stderr[-3000:]
    for rank in range(2):
        pid, started = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert _exits(int(pid), within=60 - (time.time() - float(started)))
