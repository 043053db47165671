"""Both launchers leave the whole trained model in the user's main process."""

import torch
from conftest import run_worker


def test_spawn_returns_every_stage_weights_to_the_main_process(reference_state, tmp_path):
    out = tmp_path / "state.pt"
    result = run_worker("spawn.py", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(out)
    assert state.keys() == reference_state.keys()
    for key, expected in reference_state.items():
        torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-5)
