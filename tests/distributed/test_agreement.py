"""Every stage reads the same batch, on stage processes (tests/workers/agreement.py): a shuffled loader with random
draws on the data path and on the stages pairs every row with its own label (one pipeline, and pp 2 x dp 2), a
loader that diverges stops every process naming the batch, and rank 0's callbacks see the step's real loss."""

import json

import pytest
from conftest import shared_run

ONE_PIPELINE = shared_run("agreement.py", "--devices=2", devices=2, timeout=200)
TWO_PIPELINES = shared_run("agreement.py", "--devices=4", "--pipeline=2", devices=4, timeout=200)
ROWS, EPOCHS = 64, 3


@pytest.mark.parametrize("run, last_stages", [(ONE_PIPELINE, [1]), (TWO_PIPELINES, [1, 3])])
def test_a_shuffled_loader_pairs_every_row_with_its_own_label_on_the_last_stage(run, last_stages):
    out = run() / "probe"
    shards = []
    for rank in last_stages:
        probe = json.loads((out / f"probe_rank{rank}.json").read_text())
        assert probe["foreign"] == {str(epoch): 0 for epoch in range(EPOCHS)}
        shards.append(probe["read"])
    for epoch in map(str, range(EPOCHS)):
        read = [row for shard in shards for row in shard[epoch]]
        assert sorted(read) == list(range(ROWS))  # each epoch reads every row once, over the replicas
    orders = [shards[0][str(epoch)] for epoch in range(EPOCHS)]
    assert orders[0] != orders[1] != orders[2]  # reshuffled every epoch


@pytest.mark.parametrize("run, processes", [(ONE_PIPELINE, 2), (TWO_PIPELINES, 4)])
def test_a_loader_that_diverges_stops_every_process_naming_the_batch(run, processes):
    out = run() / "mismatch"
    for rank in range(processes):
        message = (out / f"mismatch_rank{rank}.txt").read_text()
        assert message.startswith("The stages of a pipeline read different batches at epoch 0, training batch 0")
        assert "likely causes are a sampler or shuffle" in message


@pytest.mark.parametrize("run, stages", [(ONE_PIPELINE, [[0, 1]]), (TWO_PIPELINES, [[0, 1], [2, 3]])])
def test_each_stage_draws_from_its_own_stream_and_rank_zero_sees_the_real_loss(run, stages):
    out = run() / "probe"
    draws = {rank: json.loads((out / f"draws_rank{rank}.json").read_text()) for pipeline in stages for rank in pipeline}
    assert draws[0] != draws[1]  # stage 0's dropout and stage 1's are independent
    if len(stages) == 2:
        assert draws[0] == draws[2] and draws[1] == draws[3]  # replicas of a stage share their seed, as with DDP
    for first, last in stages:
        seen = json.loads((out / f"losses_rank{first}.json").read_text())["seen"]
        computed = json.loads((out / f"losses_rank{last}.json").read_text())["computed"]
        assert len(seen) == EPOCHS * ROWS // 16 // len(stages)
        assert seen == pytest.approx(computed, abs=1e-6) and min(seen) > 0
