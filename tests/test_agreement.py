"""Every stage reads the same batch: a shuffled loader with random draws on the data path and on the stages pairs
every row with its own label (one pipeline, and pp 2 x dp 2), a loader that diverges stops every process naming the
batch, and rank 0's callbacks see the step's real loss (tests/workers/agreement.py). In-process: the fingerprint,
the random streams and the sampler that the strategy gives a shuffled loader."""

import json
import random

import pytest
import torch
from conftest import shared_run
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_gpipe.agreement import StepAgreement, fingerprint
from lightning_gpipe.data import same_batches
from lightning_gpipe.job import Job
from lightning_gpipe.randomness import StageRandomness, stage_states

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


def test_the_fingerprint_sees_the_order_and_content_of_rows_but_not_memory_addresses():
    x, y = torch.randn(8, 3, 4), torch.arange(8)
    batch = {"x": x, "y": y, "names": [f"row {i}" for i in range(8)], "object": object()}
    same = {"x": x.clone(), "y": y.clone(), "names": list(batch["names"]), "object": object()}
    assert fingerprint(batch) == fingerprint(same)
    swapped = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])
    assert fingerprint({**batch, "x": x[swapped]}) != fingerprint(batch)
    assert fingerprint({**batch, "y": y[swapped]}) != fingerprint(batch)
    assert fingerprint({**batch, "names": batch["names"][::-1]}) != fingerprint(batch)
    assert fingerprint((torch.tensor(2.0), torch.zeros(0), torch.ones(3, dtype=torch.bool))) >= 0


def test_one_process_agrees_with_itself_and_passes_its_requests_through():
    agreement = StepAgreement(replica=0, replicas=1, device=torch.device("cpu"), names={0: "stage 0"}, job=Job())
    assert agreement.agree((torch.randn(4, 2),), [True, False], lambda: "epoch 0, training batch 0") == [True, False]


def test_the_stage_stream_leaves_the_shared_stream_where_it_was():
    torch.manual_seed(3)
    random.seed(3)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(3)
    random.seed(3)
    randomness = StageRandomness(stage_states(seed=3, stage_index=1))
    with randomness.stage():
        first = torch.rand(2)
        with randomness.stage():  # re-entrant: still the stage stream
            second = torch.rand(2)
        random.random()
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    with randomness.stage():
        assert not torch.equal(torch.rand(2), first)  # the stage stream went on where it stopped
    alone = StageRandomness(stage_states(seed=3, stage_index=1))
    with alone.stage():
        assert torch.equal(torch.rand(2), first) and torch.equal(torch.rand(2), second)
    other = StageRandomness(stage_states(seed=3, stage_index=0))
    with other.stage():
        assert not torch.equal(torch.rand(2), first)  # another stage, another stream


def test_a_shuffled_loader_of_one_pipeline_is_ordered_by_the_seed_and_the_epoch(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    data = list(range(10))
    shuffled = same_batches(DataLoader(data, batch_size=2, shuffle=True), 0, 1, resample=True)
    assert isinstance(shuffled.sampler, DistributedSampler) and shuffled.sampler.seed == 5
    kept = [
        DataLoader(data, batch_size=2),  # in order
        DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(1))),  # the user's seed
    ]
    for loader in kept:
        assert same_batches(loader, 0, 1, resample=True) is loader
    assert type(same_batches(DataLoader(data, shuffle=True), 0, 1, resample=False).sampler) is RandomSampler
    assert type(same_batches(DataLoader(data, shuffle=True), 0, 2, resample=True).sampler) is RandomSampler
    assert isinstance(kept[0].sampler, SequentialSampler)
