"""Schedules as data: every schedule's plans for K in 2..8, M in 1..16, each checkpoint mode, with and without
deferred weight gradients, pair their transfers, run to their end, hold each micro-batch's work once, and are what
the simulator times; a broken plan is an error naming the stage and the action."""

import pytest

from lightning_gpipe.rematerialization import CHECKPOINT_MODES, checkpointed
from lightning_gpipe.schedule import SCHEDULES, Action, Kind, Plan, ScheduleError, check, format_plans, plans
from lightning_gpipe.simulator import StageCost, simulate


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("defer", [False, True])
def test_every_plan_pairs_its_transfers_runs_to_its_end_and_is_what_the_simulator_times(schedule, defer):
    for num_stages in range(2, 9):
        for count in range(1, 17):
            for mode in CHECKPOINT_MODES:
                stage_plans = plans(schedule, num_stages, count, mode, defer)
                check(stage_plans)
                for k, plan in enumerate(stage_plans):
                    assert plan.count(Kind.FORWARD) == plan.count(Kind.BACKWARD) == count
                    assert plan.count(Kind.RECOMPUTE) == sum(checkpointed(mode, i, count) for i in range(count))
                    assert plan.count(Kind.WEIGHT) == (count if defer and k > 0 else 0)
                    assert plan.count(Kind.SEND) == (0 if k == num_stages - 1 else count)
                    assert plan.actions[-1] == Action(Kind.FLUSH)
                costs = [StageCost(1.0, 2.0, weight=0.5 if defer else 0.0)] * num_stages
                prediction = simulate(costs, count, mode, schedule=schedule)
                for k, stage in enumerate(prediction.trace.stages):  # the simulator ran each plan's compute actions
                    ran = [(s.kind, s.micro_batch) for s in stage.spans if s.kind in ("forward", "recompute")]
                    expected = [
                        (a.kind.value, a.micro_batch)
                        for a in stage_plans[k].actions
                        if a.kind in (Kind.FORWARD, Kind.RECOMPUTE)
                    ]
                    assert ran == expected


def test_the_ideal_step_and_bubble_of_both_schedules():
    for schedule in SCHEDULES:
        prediction = simulate([StageCost(1.0, 2.0)] * 4, 8, "never", schedule=schedule)
        assert prediction.step_time == pytest.approx((8 + 4 - 1) * 3.0)
        assert prediction.bubble == pytest.approx(3 / 11)


def test_fill_drain_runs_the_fill_in_training_step_and_1f1b_the_whole_step():
    fill_drain, one_f_one_b = plans("gpipe", 2, 2, "except_last"), plans("1f1b", 2, 2, "except_last")
    assert format_plans(fill_drain) == (
        "stage 0: F0 S0 F1 S1 | E1 E0 B1 R0 B0 flush\nstage 1: F0 F1 | L E1 E0 B1 R0 B0 flush"
    )
    assert format_plans(one_f_one_b) == (
        "stage 0: F0 S0 E0 F1 S1 E1 R0 B0 B1 flush\nstage 1: F0 L0 R0 B0 F1 flush L1 B1 flush"
    )
    assert not fill_drain[0].loss_per_micro_batch and one_f_one_b[1].loss_per_micro_batch


def _without(plan: Plan, action: Action) -> Plan:
    return Plan(tuple(a for a in plan.actions if a != action), plan.cut, plan.loss_per_micro_batch)


def test_a_broken_plan_is_an_error_naming_the_stage_and_the_action():
    first, last = plans("gpipe", 2, 3, "never")
    swapped = first.actions[2:4] + first.actions[:2] + first.actions[4:]  # runs and sends micro-batch 1 before 0
    with pytest.raises(ScheduleError, match="stage 1 runs forward 0 but stage 0 sends micro-batch 1 first"):
        check([Plan(swapped, first.cut), last])
    with pytest.raises(ScheduleError, match="stage 0 runs backward 2 without its gradient's receive posted first"):
        check([_without(first, Action(Kind.EXPECT, 2)), last])
    waits_for_itself = Plan((Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 0)), 1)
    with pytest.raises(ScheduleError, match="stage 0 runs backward 0 before forward 0"):
        check([waits_for_itself, last])
    never_sent = _without(first, Action(Kind.SEND, 2))
    with pytest.raises(ScheduleError, match=r"would wait for each other: stage 0 at B2 \(no gradient from stage 1"):
        check([never_sent, last])
    (alone,) = plans("gpipe", 1, 3, "never")
    with pytest.raises(ScheduleError, match=r"stage 0 runs forwards \[0, 1, 2\] but backwards \[1, 2\]"):
        check([_without(alone, Action(Kind.BACKWARD, 0))])
    with pytest.raises(ValueError, match="Unknown schedule '2f2b'; choose one of gpipe, 1f1b"):
        plans("2f2b", 2, 3, "never")
