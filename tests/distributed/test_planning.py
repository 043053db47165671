"""plan="auto" on stage processes (tests/workers/planning.py): one profile, one plan on every stage, and the same
training as the chosen options given by hand."""

import json

from conftest import shared_run

PLANNED = shared_run("planning.py", "--devices=2", devices=2, timeout=300)


def test_every_stage_runs_the_plan_rank_zero_profiled_and_chose():
    tmp_path = PLANNED()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["report"] == ranks[1]["report"]  # one profile, broadcast; the same choice everywhere
    chosen = ranks[0]["report"]["chosen"]
    assert (chosen["pipeline_parallel_size"], chosen["data_parallel_size"]) == (2, 1)  # the launched mesh
    assert all(total <= 2**30 for total in chosen["peak_bytes"])
    assert chosen["virtual_stages"] == 2  # fixed by the user, kept by the planner
    kept = ("balance", "chunks", "checkpoint", "schedule", "virtual_stages")
    assert ranks[0]["ran"] == {key: chosen[key] for key in kept}
    assert [len(r["local"]) for r in ranks] == [sum(chosen["balance"][k::2]) for k in range(2)]  # chunks k, k + 2
    assert ranks[0]["same_as_given"]  # planning changed neither the data nor the random state
