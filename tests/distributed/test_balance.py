"""Automatic balance on stage processes (tests/workers/balance.py): rank 0 profiles, every stage splits alike; the
split checked against the stages' (injected) measured times and re-split in place (tests/workers/resplit.py)."""

import json

import pytest
import torch
from conftest import assert_states_close, shared_run
from rowwise import adamw_reference

PROFILED = shared_run("balance.py", "--devices=2", devices=2, timeout=240)


def test_strategy_profiles_on_rank_zero_and_every_stage_splits_alike():
    tmp_path = PROFILED()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["costs"] == ranks[1]["costs"] and len(ranks[0]["costs"]) == 8  # broadcast from rank 0
    assert ranks[0]["local"] + ranks[1]["local"] == [str(i) for i in range(8)]
    assert [c["forward"] for c in ranks[0]["costs"]] == [0, 30, 30, 0, 0, 0, 0, 0]  # on the worker's clock
    assert [len(r["local"]) for r in ranks] == ranks[0]["expected"] == [2, 6]  # the time split, not the params one
    assert ranks[0]["micro_batch_rows"] == 5  # batches of 20 rows in 4 micro-batches
    assert ranks[0]["same_as_given_split"]  # profiling changed neither the data nor the random state


SPLIT_CHOICE = shared_run("default_split.py", "--devices=2", devices=2, timeout=240)


def test_the_default_chooses_the_backward_split_once_alike_on_every_stage_and_keeps_what_the_user_fixed():
    tmp_path = SPLIT_CHOICE()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["default"]["split"] == ranks[1]["default"]["split"]  # decided once, agreed
    assert ranks[0]["default"]["profiled"]  # chosen from the layers' measured costs
    (line,) = ranks[0]["default"]["lines"]  # one line, on global rank 0 only
    assert ranks[1]["default"]["lines"] == []
    chosen = "defer_weight_grad=True" if ranks[0]["default"]["split"] else "defer_weight_grad=False"
    assert chosen in line and "predicted" in line and "ms per step" in line
    for fixed, split in (("whole_fixed", False), ("split_fixed", True), ("schedule_fixed", False)):
        assert [r[fixed]["split"] for r in ranks] == [split, split], fixed  # never overridden
        assert [r[fixed]["lines"] for r in ranks] == [[], []], fixed  # nothing chosen, nothing said
        assert not ranks[0][fixed]["profiled"], fixed  # and nothing profiled for it


RESPLIT = shared_run("resplit.py", "--devices=2", devices=2, timeout=240)


def stages_of(out, run: str) -> list[dict]:
    return [torch.load(out / f"{run}_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_bad_profiled_split_is_re_split_in_place_exactly_with_its_optimizer_state(schedule):
    out, reference = RESPLIT(), adamw_reference()
    ranks, run = stages_of(out, f"time_{schedule}"), torch.load(out / f"time_{schedule}.pt", weights_only=False)
    assert [r["before"] for r in ranks] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]  # the profile's [4, 4]
    assert [r["after"] for r in ranks] == [["0", "1"], ["2", "3", "4", "5", "6", "7"]]  # re-split after step 3
    record = ranks[0]["record"]
    assert record == ranks[1]["record"] and record["resplit"] == [2, 6] and record["measured_s"] == [0.011, 0.004]
    assert record["best_step_s"] <= 0.95 * record["predicted_step_s"]
    # layers 2 and 3 moved to stage 1 with their AdamW state: 3 steps taken on stage 0, 3 on stage 1
    moved = {
        name: float(s["step"])
        for name, s in ranks[1]["state"].items()
        if name.startswith(("backbone.2.", "backbone.3."))
    }
    assert moved == {f"backbone.{i}.linear.{p}": 6.0 for i in (2, 3) for p in ("weight", "bias")}
    assert not any(name.startswith(("backbone.2.", "backbone.3.")) for name in ranks[0]["state"])
    torch.testing.assert_close(run["losses"], reference["losses"], rtol=0, atol=1e-5)  # one device, every step
    assert_states_close(run["state"], reference["state"])
    if schedule == "gpipe":  # bit for bit the run that kept [4, 4]: nothing was lost or rounded in the move
        kept = torch.load(out / "given.pt", weights_only=False)
        assert run["losses"] == kept["losses"]
        assert all(torch.equal(run["state"][key], kept["state"][key]) for key in kept["state"])
        report = json.loads((out / "time_gpipe" / "pipeline_balance.json").read_text())
        assert report["resplit"] == record


def test_a_balance_the_user_gave_is_never_re_split():
    ranks = stages_of(RESPLIT(), "given")  # the same injected times as the re-split runs
    assert [r["after"] for r in ranks] == [r["before"] for r in ranks] == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    assert [r["record"] for r in ranks] == [None, None]  # not even checked
