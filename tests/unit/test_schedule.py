"""Schedules as data: every schedule's plans for K in 2..8, M in 1..16, each checkpoint mode, with and without
deferred weight gradients, pair their transfers, run to their end, hold each micro-batch's work once, and are what
the simulator times; a broken plan is an error naming the stage and the action."""

import random

import pytest

from lightning_gpipe.engine.actions import Action, ActionCost, Kind, Plan, stage_of_virtual, virtual_stage
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES, checkpointed
from lightning_gpipe.engine.schedule import (
    DEFERRED_BY_DEFAULT,
    SCHEDULES,
    V_MEMORY,
    V_SHAPED,
    ScheduleError,
    check,
    evaluation,
    format_plans,
    held_limit,
    plans,
)
from lightning_gpipe.planning.simulator import StageCost, action_costs, simulate

LOOPED = [name for name in SCHEDULES if name not in V_SHAPED]


@pytest.mark.parametrize("schedule", LOOPED)
@pytest.mark.parametrize("defer", [False, True])
def test_every_plan_pairs_its_transfers_runs_to_its_end_and_is_what_the_simulator_times(schedule, defer):
    if DEFERRED_BY_DEFAULT[schedule] and not defer:  # the zero-bubble schedules
        with pytest.raises(ValueError, match=f"'{schedule}' runs each weight gradient apart .* needs the B/W split"):
            plans(schedule, 2, 4, "never", defer)
        return
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


def test_the_ideal_step_and_bubble_of_fill_drain_and_1f1b():
    for schedule in ("gpipe", "1f1b"):
        prediction = simulate([StageCost(1.0, 2.0)] * 4, 8, "never", schedule=schedule)
        assert prediction.step_time == pytest.approx((8 + 4 - 1) * 3.0)
        assert prediction.bubble == pytest.approx(3 / 11)


@pytest.mark.parametrize("num_stages, count", [(2, 4), (2, 8), (3, 8), (4, 8), (4, 16)])
def test_zb_h1_has_the_papers_bubble_with_1f1bs_memory(num_stages, count):
    """F = B = W = 1 (stage 0 does not split: its backward is B + W = 2): the step of ZB-H1 is
    M (F + B + W) + (K - 1)(F + B - W), against (M + K - 1)(F + B + W) for 1F1B with or without the split."""
    costs = [StageCost(1.0, 2.0, weight=1.0, input_bytes=1, activation_bytes=10)] * num_stages
    zero_bubble = simulate(costs, count, "never", schedule="zb-h1")
    one_f_one_b = simulate(costs, count, "never", schedule="1f1b", defer_weight_grad=False)
    assert zero_bubble.step_time == pytest.approx(3 * count + (num_stages - 1))
    assert one_f_one_b.step_time == pytest.approx(3 * (count + num_stages - 1))
    assert zero_bubble.bubble == pytest.approx((num_stages - 1) / (3 * count + num_stages - 1))
    assert zero_bubble.bubble < simulate(costs, count, "never", schedule="1f1b").bubble < one_f_one_b.bubble
    held = min(num_stages, count) * 11  # 1F1B's stage 0 holds K micro-batches; ZB-H1 holds that on every stage
    assert one_f_one_b.peak_activation_bytes[0] == held
    assert zero_bubble.peak_activation_bytes == [held] * num_stages


@pytest.mark.parametrize("mode", CHECKPOINT_MODES)
def test_zb_h1_runs_the_w_of_stage_k_k_micro_batches_after_its_b(mode):
    num_stages, count = 4, 6
    for k, plan in enumerate(plans("zb-h1", num_stages, count, mode)):
        order = [(a.kind, a.micro_batch) for a in plan.actions if a.kind in (Kind.BACKWARD, Kind.WEIGHT)]
        if k == 0:  # sends no input gradient: its backwards stay whole
            assert order == [(Kind.BACKWARD, j) for j in range(count)]
            continue
        expected = [(Kind.BACKWARD, j) for j in range(k)]
        for j in range(k, count):
            expected += [(Kind.BACKWARD, j), (Kind.WEIGHT, j - k)]
        expected += [(Kind.WEIGHT, j) for j in range(count - k, count)]
        assert order == expected
        # the 1F1B order of forwards and input gradients, each W where it was (1F1B's plan, W dropped)
        one_f_one_b = plans("1f1b", num_stages, count, mode)[k]
        assert [a for a in plan.actions if a.kind is not Kind.WEIGHT] == list(one_f_one_b.actions)


def test_fill_drain_runs_the_fill_in_training_step_and_1f1b_the_whole_step():
    fill_drain, one_f_one_b = plans("gpipe", 2, 2, "except_last"), plans("1f1b", 2, 2, "except_last")
    assert format_plans(fill_drain) == (
        "stage 0: F0 S0 F1 S1 | E1 E0 B1 R0 B0 flush\nstage 1: F0 F1 | L E1 E0 B1 R0 B0 flush"
    )
    assert format_plans(one_f_one_b) == (
        "stage 0: F0 S0 E0 F1 S1 E1 R0 B0 B1 flush\nstage 1: F0 L0 R0 B0 F1 L1 B1 flush"
    )
    assert not fill_drain[0].loss_per_micro_batch and one_f_one_b[1].loss_per_micro_batch
    assert format_plans(plans("zb-h1", 2, 3, "never")) == (
        "stage 0: F0 S0 E0 F1 S1 E1 B0 F2 S2 E2 B1 B2 flush\nstage 1: F0 L0 B0 F1 L1 B1 W0 F2 L2 B2 W1 W2 flush"
    )


def test_plans_say_when_inputs_are_all_received_ahead_and_when_a_loss_runs_on_through_the_stage():
    """Fill-drain holds every input by the end of its fill, so its stages receive them all ahead; a 1F1B stage does
    not (it would hold M receive buffers for its K - k micro-batches), nor does evaluation, which keeps no input. Only
    the last stage of a plan whose backwards follow their losses may backpropagate a loss through the stage."""
    fill_drain, one_f_one_b = plans("gpipe", 3, 4, "except_last"), plans("1f1b", 3, 4, "except_last")
    assert [(p.forwards_first, p.backward_follows_loss) for p in fill_drain] == [(True, False)] * 3
    assert [(p.forwards_first, p.backward_follows_loss) for p in one_f_one_b] == [(False, False)] * 2 + [(False, True)]
    assert not any(plan.forwards_first for plan in evaluation(3, 4))
    assert plans("zb-h1", 2, 3, "never", True)[1].backward_follows_loss  # each B right after its loss (W later)


def _without(plan: Plan, action: Action) -> Plan:
    return Plan(tuple(a for a in plan.actions if a != action), plan.backward_from, plan.loss_per_micro_batch)


def test_a_broken_plan_is_an_error_naming_the_stage_and_the_action():
    first, last = plans("gpipe", 2, 3, "never")
    swapped = first.actions[2:4] + first.actions[:2] + first.actions[4:]  # runs and sends micro-batch 1 before 0
    with pytest.raises(ScheduleError, match="stage 1 runs forward 0 but stage 0 sends micro-batch 1 first"):
        check([Plan(swapped, first.backward_from), last])
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
    with pytest.raises(ValueError, match="Unknown schedule '2f2b'; choose one of gpipe, 1f1b, zb-h1, zb-1p, zb-v"):
        plans("2f2b", 2, 3, "never")


# --------------------------------------------------------------------------- virtual stages (model chunks)


@pytest.mark.parametrize("schedule", LOOPED)
def test_every_interleaved_plan_runs_to_its_end_and_ends_with_its_first_chunk(schedule):
    for num_stages in range(2, 6):
        for virtual in range(2, 4):
            for count in range(1, 13):
                for mode, defer in [("never", True), ("always", DEFERRED_BY_DEFAULT[schedule]), ("except_last", True)]:
                    stage_plans = plans(schedule, num_stages, count, mode, defer, virtual)
                    check(stage_plans)  # pairs every virtual link's transfers, including M not a multiple of K
                    for k, plan in enumerate(stage_plans):
                        for model_chunk in range(virtual):
                            runs = [a for a in plan.actions if a.model_chunk == model_chunk]
                            assert sum(a.kind is Kind.FORWARD for a in runs) == count
                            split = defer and model_chunk * num_stages + k > 0
                            assert sum(a.kind is Kind.WEIGHT for a in runs) == (count if split else 0)
                        # the data-parallel gradient sync starts at the first chunk's last backward
                        last = [a for a in plan.actions if a.kind in (Kind.BACKWARD, Kind.WEIGHT)][-1]
                        assert last.model_chunk == 0


def test_interleaved_plans_visit_every_stage_once_per_chunk():
    assert format_plans(plans("gpipe", 2, 2, "never", False, 2)) == (
        "stage 0: F0 S0 F1 S1 F0.1 S0.1 F1.1 S1.1 | E1.1 E0.1 E1 E0 B1.1 B0.1 B1 B0 flush\n"
        "stage 1: F0 S0 F1 S1 F0.1 F1.1 | L E1.1 E0.1 E1 E0 B1.1 B0.1 B1 B0 flush"
    )
    # Megatron-LM's warm-up: 2 (K - k - 1) + (v - 1) K forwards, then one forward, one backward
    assert format_plans(plans("1f1b", 2, 2, "never", False, 2)) == (
        "stage 0: F0 S0 E0 F1 S1 E1 F0.1 S0.1 E0.1 F1.1 S1.1 E1.1 B0.1 B1.1 B0 B1 flush\n"
        "stage 1: F0 S0 E0 F1 S1 E1 F0.1 L0.1 B0.1 F1.1 L1.1 B1.1 B0 B1 flush"
    )
    # ZB-H1 interleaved: stage 1 runs each W one backward after its B, of whichever chunk
    assert format_plans(plans("zb-h1", 2, 2, "never", True, 2)).endswith(
        "L0.1 B0.1 F1.1 L1.1 B1.1 W0.1 B0 W1.1 B1 W0 W1 flush"
    )


def test_a_broken_interleaved_plan_names_the_stage_and_chunk():
    first, last = plans("gpipe", 2, 2, "never", False, 2)
    never_sent = _without(first, Action(Kind.SEND, 1, 1))
    with pytest.raises(ScheduleError, match=r"stage 1 at F1.1 \(no activation from stage 0 model chunk 1 yet\)"):
        check([never_sent, last])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_virtual_stages_shrink_the_bubble_to_k_minus_1_over_vm_plus_k_minus_1(schedule):
    for virtual in (1, 2, 4):
        costs = [StageCost(1.0 / virtual, 2.0 / virtual)] * (2 * virtual)  # 2 stages' work, cut into 2v chunks
        prediction = simulate(costs, 8, "never", schedule=schedule, virtual_stages=virtual)
        assert prediction.bubble == pytest.approx(1 / (virtual * 8 + 1))
        assert prediction.step_time == pytest.approx(3 * (8 + 1 / virtual))


def test_virtual_stages_hold_fill_drains_memory_or_interleaved_1f1bs_warm_up():
    costs = [StageCost(0.5, 1.0, input_bytes=1, activation_bytes=5)] * 4  # K = 2 stages of 2 chunks
    looped = simulate(costs, 8, "never", schedule="gpipe", virtual_stages=2)
    assert looped.peak_activation_bytes == [2 * 8 * 6] * 2  # every micro-batch on both chunks, each chunk apart
    interleaved = simulate(costs, 8, "never", schedule="1f1b", virtual_stages=2)
    assert interleaved.peak_activation_bytes == [5 * 6, 3 * 6]  # 2 (K - k - 1) + (v - 1) K warm-up forwards + 1


# --------------------------------------------------------------------------- ZB-1p: W placed by cost


def _random_costs(rng: random.Random, num_virtual: int) -> list[StageCost]:
    """F in [0.5, 2] s, B and W each 0.5-2 times F, per virtual stage."""
    costs = []
    for _ in range(num_virtual):
        forward = rng.uniform(0.5, 2.0)
        weight = forward * rng.uniform(0.5, 2.0)
        costs.append(StageCost(forward, forward * rng.uniform(0.8, 1.5) + weight, weight=weight, activation_bytes=1))
    return costs


def test_zb_1p_with_equal_costs_is_zb_h1_and_interleaved_no_slower():
    for num_stages in (2, 3, 4):
        for count in (1, 3, 8):
            for mode in CHECKPOINT_MODES:
                assert plans("zb-1p", num_stages, count, mode) == plans("zb-h1", num_stages, count, mode)
                costs = [StageCost(1.0, 2.0, weight=1.0)] * (2 * num_stages)
                zb_1p, zb_h1 = (simulate(costs, count, mode, schedule=s, virtual_stages=2) for s in ("zb-1p", "zb-h1"))
                assert zb_1p.step_time <= zb_h1.step_time


def test_zb_1p_places_w_by_cost_never_slower_than_zb_h1_with_1f1bs_transfers_and_memory():
    rng, faster = random.Random(0), 0
    for _ in range(60):
        num_stages, virtual = rng.choice([2, 3, 4]), rng.choice([1, 2])
        count, mode = rng.choice([2, 4, 8]), rng.choice(CHECKPOINT_MODES)
        costs, loss = _random_costs(rng, num_stages * virtual), rng.choice([0.0, count / 2])
        placed = plans("zb-1p", num_stages, count, mode, True, virtual, action_costs(costs, loss / count))
        check(placed)
        for plan, one_f_one_b in zip(placed, plans("1f1b", num_stages, count, mode, False, virtual)):
            assert [a for a in plan.actions if a.kind is not Kind.WEIGHT] == list(one_f_one_b.actions)
        zb_1p, zb_h1 = (
            simulate(costs, count, mode, loss=loss, schedule=name, virtual_stages=virtual)
            for name in ("zb-1p", "zb-h1")
        )
        assert zb_1p.step_time <= zb_h1.step_time * (1 + 1e-9)
        faster += zb_1p.step_time < zb_h1.step_time * 0.99
        if mode == "never":  # at most 1F1B's peak on its first stage, on every stage
            held = max(p.count(Kind.FORWARD) for p in plans("1f1b", num_stages, count, mode, False, virtual))
            one_f_one_b = simulate(costs, count, mode, schedule="1f1b", defer_weight_grad=False, virtual_stages=virtual)
            assert max(zb_1p.peak_activation_bytes) <= max(one_f_one_b.peak_activation_bytes) or held == count
    assert faster >= 10  # 14 of these 60 draws: placing W by cost pays where stages differ


def test_zb_1p_places_a_long_w_where_zb_h1_delays_the_next_forward():
    """Stage 1's W (2 s) outlasts its F and B (0.5 and 1 s), and stage 0 is slower (F 2 s, whole backward 2 s):
    ZB-H1 runs each W one backward late, before the next forward it then delays; placed by cost, the W go where
    stage 1 waits for stage 0 anyway, and the step is 32 s instead of 33.5."""
    costs = [StageCost(2.0, 2.0), StageCost(0.5, 3.0, weight=2.0)]
    zb_1p, zb_h1 = (simulate(costs, 8, "never", schedule=name) for name in ("zb-1p", "zb-h1"))
    assert (zb_1p.step_time, zb_h1.step_time) == (pytest.approx(32.0), pytest.approx(33.5))
    with pytest.raises(ValueError, match="'zb-1p' takes one cost per virtual stage: 2, not 1"):
        plans("zb-1p", 2, 8, "never", True, 1, action_costs(costs[:1]))


# --------------------------------------------------------------------------- ZB-V: two chunks per stage in a V


def test_a_v_places_chunk_1_of_stage_k_at_virtual_stage_2k_minus_1_minus_k():
    assert [virtual_stage(k, c, 3, v_shape=True) for k in range(3) for c in range(2)] == [0, 5, 1, 4, 2, 3]
    assert [virtual_stage(k, c, 3) for k in range(3) for c in range(2)] == [0, 3, 1, 4, 2, 5]  # looped
    for v_shape in (False, True):
        for s in range(6):
            assert virtual_stage(*stage_of_virtual(s, 3, v_shape), 3, v_shape) == s


def test_zb_v_runs_to_its_end_and_holds_the_head_and_the_input_on_stage_0():
    for num_stages in range(2, 7):
        for count in range(1, 13):
            for mode in CHECKPOINT_MODES:
                stage_plans = plans("zb-v", num_stages, count, mode, None, 2)
                check(stage_plans)
                check(evaluation(num_stages, count, 2, v_shape=True), training=False)
                for k, plan in enumerate(stage_plans):
                    assert plan.v_shape and plan.loss_per_micro_batch
                    for model_chunk in range(2):
                        runs = [a for a in plan.actions if a.model_chunk == model_chunk]
                        assert sum(a.kind is Kind.FORWARD for a in runs) == count
                        split = virtual_stage(k, model_chunk, num_stages, True) > 0  # the first's are whole
                        assert sum(a.kind is Kind.WEIGHT for a in runs) == (count if split else 0)
                        head = k == 0 and model_chunk == 1
                        assert sum(a.kind is Kind.LOSS for a in runs) == (count if head else 0)
                        assert sum(a.kind is Kind.SEND for a in runs) == (0 if head else count)
                    last = [a for a in plan.actions if a.kind in (Kind.BACKWARD, Kind.WEIGHT)][-1]
                    assert last.model_chunk == 0  # where the data-parallel sync starts


def test_zb_v_is_faster_than_zb_1p_at_1f1bs_memory():
    """Equal F, B and W on two stages' worth of work cut into 2K chunks: ZB-V's step is no longer than ZB-1p's with
    one chunk per stage, and it holds no more than 1F1B's first stage (K micro-batches of a whole stage)."""
    for num_stages in (2, 3, 4):
        for count in (4, 8, 16):
            halves = [StageCost(0.5, 1.0, weight=0.5, activation_bytes=50)] * (2 * num_stages)
            wholes = [StageCost(1.0, 2.0, weight=1.0, activation_bytes=100)] * num_stages
            zb_v = simulate(halves, count, "never", schedule="zb-v", virtual_stages=2)
            zb_1p = simulate(wholes, count, "never", schedule="zb-1p")
            one_f_one_b = simulate(wholes, count, "never", schedule="1f1b", defer_weight_grad=False)
            assert zb_v.step_time <= zb_1p.step_time < one_f_one_b.step_time
            assert max(zb_v.peak_activation_bytes) <= max(one_f_one_b.peak_activation_bytes)
    assert simulate([StageCost(0.5, 1.0, weight=0.5)] * 4, 8, "never", schedule="zb-v", virtual_stages=2).step_time == (
        pytest.approx(24.5)  # 8 micro-batches of 3 s per stage, and half a backward's bubble
    )


def test_zb_v_places_w_by_cost_and_refuses_other_chunk_counts():
    rng = random.Random(1)
    for _ in range(20):
        num_stages, count, mode = rng.choice([2, 3, 4]), rng.choice([2, 5, 8]), rng.choice(CHECKPOINT_MODES)
        costs = _random_costs(rng, 2 * num_stages)
        check(plans("zb-v", num_stages, count, mode, True, 2, action_costs(costs, 0.1)))
    with pytest.raises(ValueError, match="'zb-v' places two model chunks per stage in a V: it needs virtual_stages=2"):
        plans("zb-v", 2, 4, "never", True, 1)
    with pytest.raises(ValueError, match="'zb-v' takes one cost per virtual stage: 4, not 2"):
        plans("zb-v", 2, 4, "never", True, 2, (ActionCost(),) * 2)
    with pytest.raises(ValueError, match="'zb-v' runs each weight gradient apart"):
        plans("zb-v", 2, 4, "never", False, 2)


def test_plans_of_the_1f1b_order_wait_for_their_sends_only_at_the_end():
    """A send is dropped once it has completed when the stage posts its next one, so no plan waits for its sends
    before the step's last action (a flush in 1F1B's steady phase cost time and freed nothing)."""
    for schedule, v, defer in (("1f1b", 1, False), ("1f1b", 2, False), ("zb-h1", 1, True), ("zb-1p", 1, True)):
        for k in (2, 3, 4):
            for m in range(1, 9):
                for plan in plans(schedule, k, m, "except_last", defer, v):
                    flushes = [n for n, action in enumerate(plan.actions) if action.kind is Kind.FLUSH]
                    assert flushes == [len(plan.actions) - 1], (schedule, k, m, v)


# --------------------------------------------------------------------------- V-Min, V-Half, V-ZB: memory in a V


def _in_flight(plan: Plan) -> int:
    """The most micro-batches of a model chunk ``plan`` holds at once between their forward and their W (or their
    whole backward, where the model chunk does not split it)."""
    split = {(a.micro_batch, a.model_chunk) for a in plan.actions if a.kind is Kind.WEIGHT}
    held = peak = 0
    for a in plan.actions:
        done = a.kind is Kind.WEIGHT or (a.kind is Kind.BACKWARD and (a.micro_batch, a.model_chunk) not in split)
        held += (a.kind is Kind.FORWARD) - done
        peak = max(peak, held)
    return peak


def test_the_v_schedules_hold_a_third_a_half_and_all_of_1f1bs_memory():
    """In micro-batches of a model chunk (half a stage): 1F1B's first stage holds 2K; V-Min ceil(2K / 3), V-Half K,
    V-ZB 2K, at least 2 (a micro-batch on both model chunks where it turns); never more than the paper's V-Min
    (K + 4) // 3, V-Half (K + 2) // 2 and V-ZB K micro-batches of a whole stage."""
    assert [held_limit(name, 4) for name in V_MEMORY] == [3, 4, 8]
    assert [held_limit(name, 2) for name in V_MEMORY] == [2, 2, 4]
    for k in range(2, 17):
        assert held_limit("v-min", k) <= 2 * ((k + 4) // 3) and held_limit("v-min", k) == max(2, -(-2 * k // 3))
        assert held_limit("v-half", k) == k <= 2 * ((k + 2) // 2) and held_limit("v-zb", k) == 2 * k
    with pytest.raises(KeyError):
        held_limit("zb-v", 4)


@pytest.mark.parametrize("schedule", list(V_MEMORY))
def test_every_v_schedule_runs_to_its_end_within_its_memory_bound(schedule):
    """For every (K, M, checkpoint): the plans pair their transfers and run (check), hold the head on stage 0, run
    each micro-batch once per model chunk, and no stage holds more micro-batches than :func:`held_limit`, which the
    busiest stage reaches once M allows."""
    for num_stages in range(2, 6):
        for count in (1, 2, 3, 5, 8, 12):
            for mode in CHECKPOINT_MODES:
                stage_plans = plans(schedule, num_stages, count, mode, None, 2)
                check(stage_plans)
                for k, plan in enumerate(stage_plans):
                    assert plan.v_shape and plan.loss_per_micro_batch and plan.actions[-1] == Action(Kind.FLUSH)
                    for model_chunk in range(2):
                        runs = [a for a in plan.actions if a.model_chunk == model_chunk]
                        assert sum(a.kind is Kind.FORWARD for a in runs) == count
                        assert sum(a.kind is Kind.RECOMPUTE for a in runs) == sum(
                            checkpointed(mode, i, count) for i in range(count)
                        )
                        split = virtual_stage(k, model_chunk, num_stages, True) > 0
                        assert sum(a.kind is Kind.WEIGHT for a in runs) == (count if split else 0)
                        assert sum(a.kind is Kind.LOSS for a in runs) == (count if (k, model_chunk) == (0, 1) else 0)
                limit = held_limit(schedule, num_stages)
                held = [_in_flight(plan) for plan in stage_plans]
                assert max(held) <= limit
                if count >= 2 * num_stages:
                    assert max(held) == limit


def test_the_v_schedules_memory_and_time_against_1f1b_on_the_simulators_clock():
    """K = 4, M = 16, two stages' worth of work cut into model chunks of half a stage, F = B = W: the predicted
    activation bytes per stage (kept inputs and saved activations) are at most 0.40x (V-Min), 0.55x (V-Half) and 1x
    (V-ZB) of 1F1B's; the tighter the memory, the longer the step; V-ZB's step is ZB-V's, shorter than 1F1B's."""
    num_stages, count = 4, 16
    halves = [StageCost(0.5, 1.0, weight=0.5, input_bytes=2, activation_bytes=48)] * (2 * num_stages)
    wholes = [StageCost(1.0, 2.0, input_bytes=4, activation_bytes=96)] * num_stages
    one_f_one_b = simulate(wholes, count, "never", schedule="1f1b")
    peak = max(one_f_one_b.peak_activation_bytes)
    assert peak == num_stages * 100
    predicted = {name: simulate(halves, count, "never", schedule=name, virtual_stages=2) for name in V_MEMORY}
    ratios = {name: max(p.peak_activation_bytes) / peak for name, p in predicted.items()}
    assert ratios == {"v-min": 3 / 8, "v-half": 4 / 8, "v-zb": 1.0}
    assert predicted["v-min"].step_time > predicted["v-half"].step_time > predicted["v-zb"].step_time
    zb_v = simulate(halves, count, "never", schedule="zb-v", virtual_stages=2)
    assert predicted["v-zb"].step_time == zb_v.step_time < one_f_one_b.step_time


def test_the_v_schedules_place_by_cost_and_refuse_other_chunk_counts():
    rng = random.Random(2)
    for _ in range(12):
        num_stages, count, mode = rng.choice([2, 3, 4]), rng.choice([2, 5, 8]), rng.choice(CHECKPOINT_MODES)
        schedule, costs = rng.choice(list(V_MEMORY)), _random_costs(rng, 2 * num_stages)
        stage_plans = plans(schedule, num_stages, count, mode, True, 2, action_costs(costs, 0.1))
        check(stage_plans)
        assert max(_in_flight(plan) for plan in stage_plans) <= held_limit(schedule, num_stages)
    with pytest.raises(ValueError, match="'v-min' places two model chunks per stage in a V: it needs virtual_stages=2"):
        plans("v-min", 2, 4, "never", True, 1)
    with pytest.raises(ValueError, match="'v-half' takes one cost per virtual stage: 4, not 2"):
        plans("v-half", 2, 4, "never", True, 2, (ActionCost(),) * 2)
    with pytest.raises(ValueError, match="'v-zb' runs each weight gradient apart"):
        plans("v-zb", 2, 4, "never", False, 2)
