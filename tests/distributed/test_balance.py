"""Automatic balance on stage processes (tests/workers/balance.py): rank 0 profiles, every stage splits alike."""

import json

from conftest import shared_run

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
