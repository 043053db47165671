"""Schedules in torch.distributed.pipelining's CSV format (:mod:`lightning_gpipe.engine.schedule_csv`): ours written
and read back, read by torch's own reader, torch's read and checked, and what our runtime cannot run refused with its
row and column."""

import itertools

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch_schedules import torch_csv, torch_reads, torch_schedule

import lightning_gpipe
from lightning_gpipe.engine import DEFERRED_BY_DEFAULT, PLACED_BY_COST, SCHEDULES, V_SHAPED, Kind, plans
from lightning_gpipe.engine.schedule import check
from lightning_gpipe.engine.schedule_csv import plans_from_csv, plans_to_csv, read_schedule

GRID = list(itertools.product((1, 2, 3), (3, 4, 8), ("never", "except_last")))
"""(K, M, checkpoint) of the round trip."""


def _cases(name: str):
    """(K, M, checkpoint, v, defer) of ``name`` in the round trip: K >= 2 for a V, v 1 and 2 otherwise, whole and split
    backwards where the schedule takes both."""
    for (k, m, checkpoint), v in itertools.product(GRID, (2,) if name in V_SHAPED else (1, 2)):
        for defer in (True,) if DEFERRED_BY_DEFAULT[name] else (False, True):
            if k > 1 or name not in V_SHAPED:
                yield k, m, checkpoint, v, defer


def _without_recomputes(stage_plans):
    return [[a for a in plan.actions if a.kind is not Kind.RECOMPUTE] for plan in stage_plans]


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_written_and_read_back_is_the_same_plans(name):
    """Exact, recomputes included, but where a schedule placed by cost puts a W between a recompute and its backward:
    the format has no recompute, and ours go right before their backward (the W placed by cost then run before it)."""
    for k, m, checkpoint, v, defer in _cases(name):
        ours = plans(name, k, m, checkpoint, defer, v)
        back = plans_from_csv(plans_to_csv(ours), k, m, checkpoint, v, defer)
        if checkpoint == "never" or name not in PLACED_BY_COST:
            assert list(back) == ours, (name, k, m, checkpoint, v, defer)
        else:
            assert _without_recomputes(back) == _without_recomputes(ours), (name, k, m, checkpoint, v, defer)


def test_a_schedule_whose_stages_run_every_forward_first_runs_its_loss_on_the_whole_batch():
    """1F1B of one micro-batch is a fill-drain in the format (which says nothing of the loss): read back, the loss
    runs once on the whole mini-batch between the phases, as ``"gpipe"``'s, the same forwards and backwards."""
    ours = plans("1f1b", 2, 1, "never")
    back = plans_from_csv(plans_to_csv(ours), 2, 1, "never")
    assert ours[1].loss_per_micro_batch and not back[1].loss_per_micro_batch
    assert back[1].actions[back[1].backward_from] == lightning_gpipe.engine.Action(Kind.LOSS)
    assert plans_to_csv(back) == plans_to_csv(ours)


@pytest.mark.parametrize("name", SCHEDULES)
def test_torch_reads_our_schedules(name, tmp_path):
    """torch's ``_PipelineScheduleRuntime._load_csv`` (torchtitan's reader) validates our CSV and lowers it to
    transfers without finding it malformed; every rank's compute actions are ours, in our order."""
    v = 2 if name in V_SHAPED else 1
    for k, m in ((2, 4), (3, 5)):
        path = tmp_path / f"{name}_{k}.csv"
        text = lightning_gpipe.export_schedule(name, k, m, path=path)
        assert path.read_text() == text
        lowered = torch_reads(path, k, m, v, name in V_SHAPED)
        rows = [row.split(",") for row in text.splitlines()]
        for rank, row in enumerate(rows):
            assert [str(a) for a in lowered[rank] if a.is_compute_op] == row, (name, k, rank)


TORCH = [
    (torch_schedules.ScheduleLoopedBFS, False),
    (torch_schedules.ScheduleInterleaved1F1B, False),
    (torch_schedules.ScheduleInterleavedZeroBubble, False),
    (torch_schedules.ScheduleZBVZeroBubble, True),
    (torch_schedules.ScheduleDualPipeV, True),
]


@pytest.mark.parametrize(("cls", "v_shape"), TORCH, ids=[cls.__name__ for cls, _ in TORCH])
def test_torchs_schedules_read_from_their_csv_pass_check(cls, v_shape):
    """torch's own schedules at K = 2, M = 4 (two stages per rank), as its ``_dump_csv`` writes them, compute only and
    with its transfers: read, they pass ``check()`` (``plans_from_csv`` checks), the same plans either way."""
    schedule = torch_schedule(cls, 2, 4, 2, v_shape)
    every = plans_from_csv(torch_csv(schedule), 2, 4, "except_last")
    assert every == plans_from_csv(torch_csv(schedule, comms=True), 2, 4, "except_last")
    check(every)
    assert all(plan.v_shape == v_shape for plan in every)


def test_torchs_looped_bfs_and_interleaved_1f1b_are_ours():
    """torch's ScheduleLoopedBFS is our looped fill-drain, its ScheduleInterleaved1F1B our interleaved 1F1B, plan for
    plan: the loss on the whole batch for the one, per micro-batch for the other."""
    bfs = torch_csv(torch_schedule(torch_schedules.ScheduleLoopedBFS, 2, 4))
    assert list(plans_from_csv(bfs, 2, 4, "always")) == plans("gpipe", 2, 4, "always", False, 2)
    interleaved = torch_csv(torch_schedule(torch_schedules.ScheduleInterleaved1F1B, 2, 4))
    assert list(plans_from_csv(interleaved, 2, 4, "always")) == plans("1f1b", 2, 4, "always", False, 2)


def test_a_smaller_batch_runs_the_first_micro_batches_of_the_schedule():
    """A batch with fewer rows than M runs the schedule's actions of its micro-batches, in the schedule's order."""
    table = read_schedule(torch_csv(torch_schedule(torch_schedules.ScheduleInterleavedZeroBubble, 2, 4)))
    for m in (1, 2, 3):
        every = table.plans("except_last", micro_batches=m)
        check(every)
        assert {a.micro_batch for plan in every for a in plan.actions} - {None} == set(range(m))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0F0,0X0\n1F0,1B0\n", r"row 1 \(rank 0\), column 2: '0X0' is not an action"),
        ("0F0,0B0\n1F0,1W0,1I0\n", r"row 2 \(rank 1\), column 2 \(1W0\): no 1I0 before it"),
        ("0F0,0B0\n1F0,1I0\n", r"row 2 \(rank 1\), column 2 \(1I0\): an I without its W"),
        ("0F0,0F1,0B0,0B1\n1F0,1B0,1B1\n", r"stage 1 \(rank 1\) runs no forward of micro-batch 1"),
        ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", r"stage 0 runs no backward \(B or I\) of micro-batch 1"),
        ("0F1,0F0,0B0,0B1\n1F0,1B0,1F1,1B1\n", r"row 1 \(rank 0\), column 1 \(0F1\): stage 0's forwards must run in"),
        ("0F0,1F0,1B0,0B0\n2F0,3F0,3B0,2B0\n", r"column 2 \(1F0\): our runtime places the virtual stages looped"),
        ("0F0,0SEND_F0,0B0\n1F0,1B0,0RECV_F0\n", r"row 2 \(rank 1\), column 3 \(0RECV_F0\): names a stage its rank"),
        ("0F0,0B0\n1F0,0F1,1B0\n", r"row 2 \(rank 1\), column 2 \(0F1\): stage 0 runs on rank 0 too"),
    ],
)
def test_what_our_runtime_cannot_run_is_refused_with_its_row_and_column(text, message):
    with pytest.raises(ValueError, match=message):
        read_schedule(text)


def test_a_schedule_for_another_pipeline_or_a_missing_file_is_refused_naming_the_fix(tmp_path):
    text = lightning_gpipe.export_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"written for 2 ranks \(K\), not 3: run it on 2 stages, with 4 micro-batches"):
        plans_from_csv(text, 3, 4)
    with pytest.raises(ValueError, match=r"written for 4 micro-batches \(M\), not 8"):
        plans_from_csv(text, 2, 8)
    with pytest.raises(FileNotFoundError, match="no such file"):
        plans_from_csv(tmp_path / "missing.csv", 2, 4)


def test_the_strategy_reads_a_csv_schedule_before_any_process_starts(tmp_path):
    """``GPipeStrategy(schedule="x.csv")`` reads the file at once: its M and v become ``chunks`` and
    ``virtual_stages``, its V the placement, its I/W the B/W split; a missing file, or options it contradicts, are
    refused naming the fix."""
    path = tmp_path / "zbv.csv"
    lightning_gpipe.export_schedule("zb-v", 2, 6, path=path)
    config = lightning_gpipe.GPipeStrategy(schedule=str(path)).config
    assert (config.chunks, config.virtual_stages, config.v_shape, config.splits_backward) == (6, 2, True, True)
    with pytest.raises(ValueError, match=r"schedule='.*missing.csv'\): schedule .* no such file"):
        lightning_gpipe.GPipeStrategy(schedule=str(tmp_path / "missing.csv"))
    with pytest.raises(ValueError, match=r"chunks=4\): the schedule is written for chunks=6; leave chunks unset"):
        lightning_gpipe.GPipeStrategy(schedule=str(path), chunks=4)
    with pytest.raises(ValueError, match=r"virtual_stages=1\): the schedule is written for virtual_stages=2"):
        lightning_gpipe.GPipeStrategy(schedule=str(path), virtual_stages=1)
    with pytest.raises(ValueError, match=r"defer_weight_grad=False\): the schedule splits backwards"):
        lightning_gpipe.GPipeStrategy(schedule=str(path), defer_weight_grad=False)
    with pytest.raises(ValueError, match=r"plan='auto'\): a CSV schedule fixes K"):
        lightning_gpipe.GPipeStrategy(schedule=str(path), plan="auto", memory_limit=2**30)


def test_a_csv_schedule_runs_and_a_pipeline_it_does_not_fit_is_refused_before_step_1(tmp_path):
    """One stage (one process) running a CSV of one rank trains as plain Lightning; one of two ranks is refused at
    setup, before step 1, naming the fix."""
    from conftest import assert_states_close
    from models import fit_trainer

    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    lightning_gpipe.export_schedule("gpipe", 1, 3, path=one)
    lightning_gpipe.export_schedule("gpipe", 2, 3, path=two)
    expected = fit_trainer().lightning_module.state_dict()
    strategy = lightning_gpipe.GPipeStrategy(schedule=str(one), pipeline_parallel_size=1)
    assert_states_close(fit_trainer(strategy=strategy).lightning_module.state_dict(), expected)
    with pytest.raises(ValueError, match=r"written for 2 ranks \(K\), not 1: run it on 2 stages"):
        fit_trainer(strategy=lightning_gpipe.GPipeStrategy(schedule=str(two), pipeline_parallel_size=1), max_steps=1)
