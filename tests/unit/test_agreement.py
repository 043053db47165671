"""Every stage reads the same batch, checked in this process: the fingerprint, the random streams and the sampler
that the strategy gives a shuffled loader (on stage processes: tests/distributed/test_agreement.py)."""

import random

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning import contract as randomness_module
from lightning_gpipe.lightning.agreement import NEUTRAL, REGION_WORDS, StepAgreement, fingerprint
from lightning_gpipe.lightning.contract import BackboneCall, StageRandomness, stage_states
from lightning_gpipe.lightning.data import same_batches
from lightning_gpipe.lightning.step import quiet_until_backward


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


def test_one_process_agrees_with_itself_and_passes_its_requests_and_relay_region_through():
    agreement = StepAgreement(replica=0, replicas=1, names={0: "stage 0"}, job=Job())
    where = lambda: "epoch 0, training batch 0"  # noqa: E731
    requests, region = agreement.agree(fingerprint((torch.randn(4, 2),)), [True, False], where, torch.tensor([5, 6]))
    assert requests == [True, False]
    assert region.shape == (REGION_WORDS,) and region[:2].tolist() == [5, 6] and (region[2:] == NEUTRAL).all()
    requests, region = agreement.agree(fingerprint((torch.randn(4, 2),)), [False], where)
    assert requests == [False] and region.size == 0
    with pytest.raises(ValueError, match="holds 1024 words"):
        agreement.agree(fingerprint(()), [], where, torch.zeros(REGION_WORDS + 1, dtype=torch.int64))


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


class _Forward:
    """A plan runner whose forward returns its input."""

    loss_per_micro_batch = False

    def forward(self, value, head=None):
        return value


def test_a_step_that_keeps_the_stage_stream_draws_as_one_that_swaps_it_twice_with_half_the_exchanges(monkeypatch):
    torch.manual_seed(3)
    streams = StageRandomness(stage_states(seed=3, stage_index=1))
    exchanges = []
    exchange = randomness_module._exchange
    monkeypatch.setattr(randomness_module, "_exchange", lambda states: exchanges.append(1) or exchange(states))

    def run(keep: bool) -> tuple[list, torch.Tensor]:
        torch.manual_seed(3)
        call, draws = BackboneCall(_Forward(), is_last=True, randomness=streams), []
        shared = torch.rand(1)  # the step before the backbone call: the shared stream
        call.user_step("training_step", lambda: draws.append(call(torch.rand(1)) * 0 + torch.rand(1)), keep=keep)
        kept = len(exchanges)
        with streams.stage():  # the drain
            draws.append(torch.rand(1))
        call.end_kept()
        return draws, (shared, torch.rand(1), kept)

    swapped, (shared, after, kept) = run(keep=False)
    assert kept == 2 and len(exchanges) == 4
    exchanges.clear()
    kept_draws, (kept_shared, kept_after, kept) = run(keep=True)
    assert kept == 1 and len(exchanges) == 2  # in at the backbone call, out after the drain
    assert torch.equal(kept_shared, shared) and torch.equal(kept_after, after)  # the shared stream draws alike
    assert not torch.equal(torch.cat(kept_draws), torch.cat(swapped))  # the stage stream went on where it stopped
    fresh = StageRandomness(stage_states(seed=3, stage_index=1))
    with fresh.stage():
        expected = [torch.rand(1) for _ in range(4)]
    assert torch.equal(torch.cat(swapped + kept_draws), torch.cat(expected))  # one stream, drawn in order


def test_a_step_that_raises_gives_the_kept_stage_stream_back_at_once():
    torch.manual_seed(3)
    streams = StageRandomness(stage_states(seed=3, stage_index=1))
    call = BackboneCall(_Forward(), is_last=True, randomness=streams)

    def failing():
        call(torch.zeros(1))
        raise ValueError("the user's head failed")

    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    with pytest.raises(ValueError, match="head failed"):
        call.user_step("training_step", failing, keep=True)
    assert torch.equal(torch.rand(1), expected)  # back on the shared stream, where it was


class _Quiet(L.LightningModule):
    pass


class _ZeroesItself(L.LightningModule):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad()


def test_the_stage_stream_is_kept_past_training_step_only_where_nothing_between_can_draw():
    def quiet(module: L.LightningModule, callbacks=(), skip=False) -> bool:
        trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=list(callbacks), enable_progress_bar=False)
        trainer.fit_loop._skip_backward = skip
        module.trainer = trainer
        return quiet_until_backward(module)

    assert quiet(_Quiet())
    assert not quiet(_ZeroesItself())
    assert not quiet(_Quiet(), [L.pytorch.callbacks.LambdaCallback(on_before_backward=lambda *args: None)])
    assert not quiet(_Quiet(), skip=True)  # StochasticWeightAveraging's last epoch: no backward comes
    manual = _Quiet()
    manual.automatic_optimization = False
    assert not quiet(manual)


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
