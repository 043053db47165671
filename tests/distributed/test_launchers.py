"""The spawn launcher leaves the whole trained model in the user's main process.

(For the default subprocess-script launcher, test_equivalence saves rank 0's module after fit: the
same check.)
"""

import torch
from conftest import beside, run_worker, scratch

OUT = scratch("spawn_")
SPAWNED = beside("launchers:spawn", lambda: run_worker("spawn.py", str(OUT / "state.pt")))
"""The run with the spawn launcher, started beside the in-process tests."""


def test_spawn_returns_every_stage_weights_to_the_main_process(reference_state):
    result = SPAWNED()
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(OUT / "state.pt")
    assert state.keys() == reference_state.keys()
    for key, expected in reference_state.items():
        torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-5)
