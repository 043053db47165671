"""No device-to-host synchronisation in a steady-state step: the package reads tensor values on the host at most
twice per step on every stage, whatever the number of micro-batches (tests/workers/host_reads.py counts them in the
shared 2-process launch). On CUDA each such read of a device tensor would stop the host until the device is idle;
the package's are of CPU tensors: a step's control message from the previous stage and the step's agreement.
"""

import json

import pytest
from conftest import shared_run

READS = shared_run("host_reads.py", devices=2, timeout=300)


# "tied": gpipe, a parameter on both stages; "packed": gpipe, a Hugging Face causal LM on packed rows whose shape
# changes every step (the CPU's stand-in for benchmarks/gpu_check.py's `packed` part)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-1p", "tied", "packed"])
def test_at_most_two_host_reads_per_step_on_every_stage_whatever_m(schedule):
    for rank in (0, 1):
        found = json.loads((READS() / f"reads_rank{rank}.json").read_text())
        few, many = found[f"{schedule}-M4"], found[f"{schedule}-M8"]
        assert few["per_step"] <= 2, (rank, few["where"])
        assert many["per_step"] == few["per_step"], (rank, few["where"], many["where"])
