"""Automatic balance on stage processes (tests/workers/balance.py): rank 0 profiles, every stage splits alike."""

import json

from conftest import shared_run

PROFILED = shared_run("balance.py", "--devices=2", devices=2, timeout=240)


def test_strategy_profiles_on_rank_zero_and_every_stage_splits_alike():
    tmp_path = PROFILED()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["costs"] == ranks[1]["costs"] and len(ranks[0]["costs"]) == 8  # broadcast from rank 0
    assert ranks[0]["local"] + ranks[1]["local"] == [str(i) for i in range(8)]
    assert [len(r["local"]) for r in ranks] == ranks[0]["expected"] != [4, 4]  # the time split, not the params one
    assert ranks[0]["micro_batch_rows"] == 5  # batches of 20 rows in 4 micro-batches
    assert ranks[0]["same_as_given_split"]  # profiling changed neither the data nor the random state
