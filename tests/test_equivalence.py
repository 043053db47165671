"""Pipelined training gives the same parameters as single-device Lightning (fp32, 1e-5).

The parameters compared are those of the module in rank 0's process after fit, so this also checks
that the subprocess-script launcher leaves every stage's weights in the user's main process.
"""

import pytest
import torch
from conftest import run_worker
from models import TupleNet, loader

CHUNKS = (1, 3, 8)
MODES = ("always", "except_last", "never")


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_equals_single_device(stages, reference_state, tmp_path):
    result = run_worker("equivalence.py", str(tmp_path), f"--devices={stages}", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    for chunks in CHUNKS:
        for mode in MODES:
            state = torch.load(tmp_path / f"M{chunks}_{mode}.pt")
            assert state.keys() == reference_state.keys()
            for key, expected in reference_state.items():
                torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-5, msg=f"{key}, M={chunks}, {mode}")
    threads = {int((tmp_path / f"threads_rank{r}.txt").read_text()) for r in range(stages)}
    assert threads == {max(1, (torch.multiprocessing.cpu_count() or 1) // stages)}
    module = TupleNet()
    module.load_state_dict(state)  # the last configuration trained
    expected = [module.predict_step(batch, i).detach() for i, batch in enumerate(loader())]
    for rank in range(stages):
        predictions = torch.load(tmp_path / f"predictions_rank{rank}.pt")
        assert len(predictions) == len(expected)
        for got, want in zip(predictions, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
