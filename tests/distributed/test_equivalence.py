"""Pipelined training gives the same parameters as single-device Lightning (fp32, 1e-5).

The parameters compared are those of the module in rank 0's process after fit, so this also checks
that the subprocess-script launcher leaves every stage's weights in the user's main process.
"""

import pytest
import torch
from conftest import shared_run
from equivalence_grid import V_SCHEDULES, fill_drain, interleaved, per_microbatch
from models import TupleNet, loader
from rowwise import adamw_reference

RUNS = {k: shared_run("equivalence.py", f"--devices={k}", devices=k, timeout=400) for k in (2, 3, 4)}


@pytest.fixture(scope="module")
def reference_1f1b_state():
    """Single-device TupleNet trained on the 1F1B runs' data: batches of 25, 25 and 2 rows."""
    from rowwise import fit_batches

    return fit_batches(batch_size=25).lightning_module.state_dict()


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_pipeline_equals_single_device(stages, reference_state, reference_1f1b_state):
    out = RUNS[stages]()
    for chunks, mode in fill_drain(stages):
        state = torch.load(out / f"M{chunks}_{mode}.pt")
        assert state.keys() == reference_state.keys()
        for key, expected in reference_state.items():
            torch.testing.assert_close(state[key], expected, rtol=0, atol=1e-5, msg=f"{key}, M={chunks}, {mode}")
    threads = {int((out / f"threads_rank{r}.txt").read_text()) for r in range(stages)}
    assert threads == {max(1, (torch.multiprocessing.cpu_count() or 1) // stages)}
    # schedule="1f1b" (and the zero-bubble ones), M = 4 >= K (uneven: 7, 6, 6, 6 rows), then M = 2 < K when K > 2
    for schedule, mode in per_microbatch(stages):
        state_1f1b = torch.load(out / f"{schedule}_{mode}.pt")
        for key, expected in reference_1f1b_state.items():
            torch.testing.assert_close(state_1f1b[key], expected, rtol=0, atol=1e-5, msg=f"{key}, {schedule}, {mode}")
    # virtual_stages=2: the looped fill-drain on fit()'s data, interleaved 1F1B, ZB-H1, ZB-1p and ZB-V (its chunks in
    # a V, the head on stage 0) on the 1F1B runs' batches
    for schedule, mode in interleaved(stages):
        state_v2 = torch.load(out / f"v2_{schedule}_{mode}.pt")
        for key, expected in (reference_state if schedule == "gpipe" else reference_1f1b_state).items():
            message = f"{key}, v=2 {schedule}, {mode}"
            torch.testing.assert_close(state_v2[key], expected, rtol=0, atol=1e-5, msg=message)
    if stages in (2, 4):  # V-Min, V-Half and V-ZB: 8 micro-batches, 6 AdamW steps, the loss of each step too
        reference = adamw_reference()
        for schedule in V_SCHEDULES:
            run = torch.load(out / f"v_{schedule}.pt")
            torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=1e-5, msg=schedule)
            for key, expected in reference["state"].items():
                message = f"{key}, {schedule}"
                torch.testing.assert_close(run["state"][key], expected, rtol=0, atol=1e-5, msg=message)
    if stages == 2:  # a schedule torch wrote, run from its CSV: per micro-batch, as 1F1B
        run = torch.load(out / "csv_torch_izb.pt")
        for key, expected in reference_1f1b_state.items():
            torch.testing.assert_close(run[key], expected, rtol=0, atol=1e-5, msg=f"{key}, torch's CSV")
    module = TupleNet()
    module.load_state_dict(state)  # the last fill-drain configuration trained
    expected = [module.predict_step(batch, i).detach() for i, batch in enumerate(loader())]
    for rank in range(stages):
        predictions = torch.load(out / f"predictions_rank{rank}.pt")
        assert len(predictions) == len(expected)
        for got, want in zip(predictions, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
