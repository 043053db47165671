"""Automatic balance: the memory-limited solver, the layer profiler, the modes (the strategy's choice on stage
processes: tests/distributed/test_balance.py)."""

import math
from itertools import combinations

import pytest
import torch
from models import TupleNet
from torch import nn

from lightning_gpipe import GPipeStrategy, balance_by, profile_layers, solve
from lightning_gpipe.engine import Topology
from lightning_gpipe.lightning.backbone import sample_micro_batch
from lightning_gpipe.lightning.build import stage_balance
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.planning.balance import LayerCost, Repeats, layer_weights, profile, resolve_balance, stage_sums


def _splits(layers: int, stages: int):
    for cuts in combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def test_memory_limited_solver_is_optimal_against_brute_force():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        costs = torch.randint(1, 20, (9,), generator=generator).tolist()
        memory = torch.randint(1, 20, (9,), generator=generator).tolist()
        limit = int(torch.randint(25, 60, (), generator=generator))
        fitting = [b for b in _splits(9, 3) if max(stage_sums(memory, b)) <= limit]
        if not fitting:
            with pytest.raises(ValueError, match="No split into 3 stages keeps every stage within"):
                solve(costs, 3, memory=memory, memory_limit=limit)
            continue
        balance = solve(costs, 3, memory=memory, memory_limit=limit)
        assert max(stage_sums(memory, balance)) <= limit
        assert max(stage_sums(costs, balance)) == min(max(stage_sums(costs, b)) for b in fitting)


def test_memory_limit_error_names_the_smallest_limit_that_fits():
    costs, memory = [1, 1, 1, 1], [4, 1, 1, 4]
    assert solve(costs, 2, memory=memory, memory_limit=6) == [2, 2]
    with pytest.raises(ValueError, match="the smallest limit that fits is 5 bytes. Raise the limit, use more devices"):
        solve(costs, 2, memory=memory, memory_limit=4)
    with pytest.raises(ValueError, match="Give both `memory`"):
        solve(costs, 2, memory=memory)


def test_memory_limit_error_names_the_option_a_strategy_user_set():
    """GPipeStrategy's option is balance_memory_limit (its memory_limit is the planner's); the adapter's error names
    it around the planner's."""
    module = nn.Module()
    module.backbone = nn.Sequential(nn.Identity(), nn.Identity())
    config = PipelineConfig(balance="memory", balance_memory_limit=4)
    with pytest.raises(
        ValueError,
        match=r"GPipeStrategy\(balance='memory', balance_memory_limit=4\): No split into 2 stages keeps every stage"
        " within the balance's memory limit of 4 bytes",
    ):
        stage_balance(module, "backbone", config, Topology(2, 2), [LayerCost(1.0, 1.0, 5)] * 2)


def test_stage_sums_takes_the_profiled_costs_as_docs_balance_md_shows():
    """``stage_sums(costs, balance)`` on ``profile_layers``'s costs: each stage's forward + backward seconds; numbers
    as before."""
    backbone = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    costs = profile_layers(backbone, torch.randn(4, 8), repeats=1)
    balance = balance_by("time", costs, num_stages=2)
    times = [c.forward + c.backward for c in costs]
    assert (
        stage_sums(costs, balance) == stage_sums(times, balance) == [sum(times[: balance[0]]), sum(times[balance[0] :])]
    )
    assert stage_sums(layer_weights("memory", costs), [2, 1]) == [
        costs[0].activation_bytes + costs[0].parameter_bytes + costs[1].activation_bytes + costs[1].parameter_bytes,
        costs[2].activation_bytes + costs[2].parameter_bytes,
    ]


def test_modes_weigh_time_memory_or_parameters():
    costs = [
        LayerCost(forward=1.0, backward=2.0, activation_bytes=10, parameter_bytes=100),
        LayerCost(forward=1.0, backward=1.0, activation_bytes=200, parameter_bytes=0),
        LayerCost(forward=5.0, backward=5.0, activation_bytes=10, parameter_bytes=10),
    ]
    assert layer_weights("time", costs) == [3.0, 2.0, 10.0]
    assert layer_weights("memory", costs) == [110, 200, 20]
    assert layer_weights("params", costs) == [100, 0, 10]
    assert balance_by("time", costs, 2) == [2, 1]
    assert balance_by("memory", costs, 2) == [1, 2]
    assert balance_by("time", costs, 2, memory_limit=220) == [1, 2]
    with pytest.raises(ValueError, match="choose one of params, time, memory"):
        balance_by("speed", costs, 2)


def test_resolve_balance_uses_profiled_costs_for_time_and_memory():
    backbone = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    costs = [LayerCost(forward=t, backward=t) for t in (1.0, 1.0, 5.0)]
    assert resolve_balance("time", backbone, 2, costs) == [2, 1]
    assert resolve_balance(None, backbone, 2) == resolve_balance("params", backbone, 2) == [1, 2]
    with pytest.raises(ValueError, match="balance='time' needs the profiled cost of each of the 3 backbone layers"):
        resolve_balance("time", backbone, 2)
    with pytest.raises(ValueError, match="fewer than the 4 stages"):
        resolve_balance("time", backbone, 4, costs)


def test_profiler_counts_saved_activations_outputs_and_parameters_exactly():
    rows, width = 6, 8
    backbone = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    costs = profile_layers(backbone, torch.randn(rows, width), repeats=1, warmup=0)
    floats = 4
    # Linear saves its input for the weight's gradient (the weight itself is a parameter, not an activation);
    # ReLU saves its output
    assert [c.activation_bytes for c in costs] == [rows * width * floats] + [rows * 2 * width * floats] * 2
    assert [c.output_bytes for c in costs] == [rows * 2 * width * floats] * 2 + [rows * width * floats]
    assert [c.parameter_bytes for c in costs] == [(width * 2 * width + 2 * width) * floats, 0] + [
        (2 * width * width + width) * floats
    ]
    assert all(c.forward > 0 and c.backward > 0 for c in costs)


def test_profiler_times_the_weight_split_and_counts_what_b_keeps_for_w():
    rows, width = 6, 8
    backbone = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
    costs = profile_layers(backbone, torch.randn(rows, width), repeats=1, warmup=0, split=True)
    first, relu, linear = costs
    assert first.input_grad == 0 and first.weight_grad > 0  # on data: no input gradient, the whole backward is W
    assert relu.input_grad > 0 and relu.kept_grad_bytes == 0  # no parameters: nothing kept for W
    assert linear.input_grad > 0 and linear.weight_grad > 0
    assert linear.kept_grad_bytes == rows * width * 4  # the output gradient, for the weight's product
    unsplit = profile_layers(backbone, torch.randn(rows, width), repeats=1)
    assert all(c.input_grad == c.weight_grad == c.kept_grad_bytes == 0 for c in unsplit)


def test_profiler_leaves_the_layers_and_random_state_untouched():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    sample, rng = torch.randn(8, 4), torch.get_rng_state()
    profile_layers(backbone, sample, repeats=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in backbone.state_dict().items())
    assert all(p.grad is None for p in backbone.parameters())


def test_profiler_handles_tuple_activations_with_masks_and_meta_layers():
    backbone = TupleNet(blocks=2).backbone
    x = torch.randn(5, 16)
    costs = profile_layers(backbone, (x, x > 0), repeats=1)
    assert len(costs) == 4 and costs[1].output_bytes == 2 * 5 * 16 * 4 + 5 * 16  # (h, skip) floats + bool mask
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    assert profile_layers(meta, x, repeats=1)[0].parameter_bytes == (16 * 16 + 16) * 4
    assert meta[0].weight.is_meta


def test_profiler_names_a_layer_that_returns_no_activation():
    class Listing(nn.Module):
        def forward(self, x):
            return [x]

    with pytest.raises(TypeError, match=r"Backbone layer 1 \(Listing\) returned a list"):
        profile_layers(nn.Sequential(nn.Linear(2, 2), Listing()), torch.randn(3, 2), repeats=1)


class ForwardNet(TupleNet):
    """TupleNet whose ``forward`` prepares the mask, with an ``example_input_array`` for it."""

    def __init__(self):
        super().__init__(blocks=2)
        self.example_input_array = torch.randn(12, 16)

    def forward(self, x):
        return self.head(self.backbone((x * 2, x > 0)))


def test_sample_is_the_first_micro_batch_of_what_forward_passes_to_the_backbone():
    module = ForwardNet()
    x, mask = sample_micro_batch(module, "backbone", micro_batches=4)
    assert torch.equal(x, module.example_input_array[:3] * 2) and torch.equal(mask, module.example_input_array[:3] > 0)
    assert isinstance(module.backbone, nn.Sequential) and len(module.backbone) == 4


def test_sample_outside_fit_needs_example_input_array():
    import lightning as L

    module = TupleNet()
    module.trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="outside `trainer.fit` it takes the module's `example_input_array`"):
        sample_micro_batch(module, "backbone", micro_batches=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(balance="fast"), "choose 'params', 'time' or 'memory', or give"),
        (dict(balance_memory_limit=0), "an integer >= 1, or None"),
        (dict(balance=[2, 2], balance_memory_limit=10**9), "the memory limit steers an automatic balance"),
    ],
)
def test_bad_balance_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**kwargs)
    assert GPipeStrategy(balance="memory", balance_memory_limit=10**9).config.balance == "memory"


class Clock:
    """Stands for the profiler's clock: seconds that pass only while :class:`Timed` layers work, so that the test's
    times are the layers' own, whatever else the machine runs. The profiler's copies of a layer share it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def __deepcopy__(self, memo: dict) -> "Clock":
        return self


class _Work(torch.autograd.Function):
    """The identity, moving ``clock`` by ``seconds`` in the forward and twice that in the backward."""

    @staticmethod
    def forward(ctx, x, clock: Clock, seconds: float):
        clock.now += seconds
        ctx.clock, ctx.seconds = clock, seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.now += 2 * ctx.seconds
        return grad, None, None


class Timed(nn.Module):
    """A ``Linear(4, 4)`` that takes ``seconds`` forward and twice that backward on ``clock``: its time is set, not its
    size."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.linear, self.clock, self.seconds = nn.Linear(4, 4), clock, seconds

    def forward(self, x):
        return _Work.apply(self.linear(x), self.clock, self.seconds)


def test_time_balance_is_the_best_split_of_layers_whose_work_differs_tenfold(monkeypatch):
    """Each layer is profiled at the time it takes (on the clock the profiler is given in place of the CPU's: a
    machine's load must not decide), and ``balance="time"`` on those costs is a split whose slowest stage is the
    fastest of every split's, three times as fast as the parameter split's (the layers' sizes are equal)."""
    clock = Clock()
    monkeypatch.setattr(profile, "_clock", lambda device: clock)
    work = (1.0, 1.0, 1.0, 10.0, 10.0, 10.0, 1.0, 1.0, 1.0)
    backbone = nn.Sequential(*[Timed(clock, seconds) for seconds in work])
    costs = profile_layers(backbone, torch.randn(32, 4), repeats=5)
    assert [(c.forward, c.backward) for c in costs] == [(seconds, 2 * seconds) for seconds in work]
    chosen = balance_by("time", costs, num_stages=3)

    def slowest(balance):
        return max(stage_sums([3 * seconds for seconds in work], balance))

    assert slowest(chosen) == min(slowest(split) for split in _splits(len(work), 3)) == 39.0
    assert slowest(resolve_balance("params", backbone, 3)) == 90.0  # [3, 3, 3]: the three slow layers on one stage


def test_a_layer_at_two_positions_is_profiled_at_each():
    """A module used at two backbone positions (tied) is one child but two layers: one cost per position, so that
    ``balance="time"`` and the schedules placed by cost see every layer."""
    shared = nn.Linear(4, 4)
    layers = nn.Sequential(shared, nn.Tanh(), shared)
    assert len(list(layers.named_children())) == 2 and len(layers) == 3
    costs = profile_layers(layers, torch.randn(8, 4), "cpu", repeats=1, warmup=0)
    assert len(costs) == 3 and costs[0].parameter_bytes == costs[2].parameter_bytes == 80


def test_measured_stage_times_re_split_a_bad_profiled_split_under_the_memory_limit_only_when_5_percent_faster():
    """The error is the stage's: a stage measured 2.75x its profile runs any layer 2.75x slower, so the check moves
    layers off it until its busiest stage is least busy at the measured speeds, [2, 6] (stage 0: 2 x 2.75 = 5.5
    units, stage 1: 6 x 1), not [3, 5] (8.25)."""
    from lightning_gpipe.lightning.resplit import Resplit, choose_resplit, measured_split, measured_stages, stage_ratios

    profile = [LayerCost(1e-3, 2e-3, parameter_bytes=10)] * 8  # every layer alike: balance="time" splits [4, 4]
    config, measured = PipelineConfig(balance="time", chunks=2), [11e-3, 4e-3]  # stage 0 measured 2.75x stage 1
    ratios = stage_ratios(profile, [4, 4], measured, 2, "except_last")
    share = 0.5  # except_last at M = 2: one of the two forwards recomputed
    assert ratios == pytest.approx([11 / (2 * 4 * (1.5 + 2)), 4 / (2 * 4 * (1.5 + 2))])
    stages = measured_stages(profile, [4, 4], ratios)
    assert [2 * (s.forward * (1 + share) + s.backward) for s in stages] == pytest.approx(measured)  # as measured
    assert [s.recompute for s in stages] == pytest.approx([s.forward for s in stages])
    moved = measured_stages(profile, [2, 6], ratios)  # 2 layers at stage 0's speed, 6 at stage 1's
    assert [2 * (s.forward * (1 + share) + s.backward) for s in moved] == pytest.approx([5.5e-3, 6e-3])
    assert measured_split(profile, ratios, 2, "except_last") == [2, 6]
    decision = choose_resplit(profile, [4, 4], measured, config, 2)
    assert decision.taken and decision.best == [2, 6] and decision.best_step < 0.95 * decision.step
    limited = PipelineConfig(balance="time", chunks=2, balance_memory_limit=50)  # no stage may hold 6 layers
    assert choose_resplit(profile, [4, 4], measured, limited, 2).best == [3, 5]
    tighter = PipelineConfig(balance="time", chunks=2, balance_memory_limit=40)  # nor 5: [4, 4] or nothing
    assert not choose_resplit(profile, [4, 4], measured, tighter, 2).taken
    assert not choose_resplit(profile, [4, 4], [4.2e-3, 4e-3], config, 2).taken  # under 5% faster: kept
    with pytest.raises(ValueError, match=r"Resplit\(warmup=3, steps=0, gain=0.05\): give warmup >= 0 .* steps >= 1"):
        Resplit(steps=0)


def test_a_layer_costs_its_new_stage_s_b_and_w_when_the_check_moves_it():
    """Under the B/W split a layer on a later stage runs B and W apart (here dearer than its whole backward): the
    check's candidate split counts each layer as the stage it would land on runs it, at that stage's ratio."""
    from lightning_gpipe.lightning.resplit import measured_split, measured_stages

    profile = [LayerCost(1e-3, 2e-3, input_grad=2e-3, weight_grad=2e-3)] * 6  # B + W = 4 ms against a 2 ms backward
    whole = measured_split(profile, [1.0, 1.0], 4, "never")  # without the split: alike everywhere
    halves = measured_split(profile, [1.0, 1.0], 4, "never", split=True)  # stage 1 pays 5 ms a layer, stage 0 3 ms
    assert whole == [3, 3] and halves == [4, 2]
    first, second = measured_stages(profile, [4, 2], [1.0, 2.0], split=True)
    assert (first.backward, first.weight) == pytest.approx((8e-3, 0.0))  # whole backwards on the first stage
    assert (second.forward, second.backward, second.weight) == pytest.approx((4e-3, 16e-3, 8e-3))  # twice as slow


def test_a_stage_is_busy_in_its_forwards_recomputes_and_backwards_not_its_loss_optimizer_or_waits():
    from lightning_gpipe.engine import Span
    from lightning_gpipe.lightning.resplit import work_seconds

    kinds = ["forward", "recv", "loss", "recompute", "backward", "weight", "send", "optimizer"]
    spans = [Span(kind, 0, float(i), i + 0.5 * (i + 1)) for i, kind in enumerate(kinds)]
    assert work_seconds(None, spans) == pytest.approx(0.5 + 2.0 + 2.5 + 3.0)  # the default time source


class Script:
    """The seconds a :class:`Noisy` layer's successive forwards take: ``seconds`` in turn, then ``then`` for ever
    (shared by the profiler's copies of the layer)."""

    def __init__(self, *seconds: float, then: float) -> None:
        self.seconds, self.then = list(seconds), then

    def __next__(self) -> float:
        return self.seconds.pop(0) if self.seconds else self.then

    def __deepcopy__(self, memo: dict) -> "Script":
        return self


class Noisy(nn.Module):
    """A ``Linear(4, 4)`` whose forwards take the seconds of ``script`` on ``clock``, a backward twice its forward."""

    def __init__(self, clock: Clock, script: Script) -> None:
        super().__init__()
        self.linear, self.clock, self.script = nn.Linear(4, 4), clock, script

    def forward(self, x):
        return _Work.apply(self.linear(x), self.clock, next(self.script))


UNTIMED = (1.0, 1.0, 1.0, 1.0)
"""The forwards the profiler runs before timing a layer: its check for in-place changes, its counted run, 2 warm-ups."""


@pytest.mark.parametrize(
    "repeats, forward, timed",
    [
        (Repeats(least=3, budget=1e3), 1.0, 13),  # settled once 10 fast runs put the 3 slow ones outside the quartiles
        (Repeats(least=3, most=6, budget=1e3), 3.0, 6),  # the cap: 6 runs, not settled
        (Repeats(least=3, budget=40.0), 5.0, 4),  # the budget: 48 s of timed runs
        (5, 5.0, 5),  # a number of runs: exactly that many (the old default, misled by the slow runs)
    ],
)
def test_the_profile_times_a_layer_until_its_runs_settle_within_a_cap(monkeypatch, repeats, forward, timed):
    """A layer slow on 3 of its first 4 timed runs (5 s against 1 s, on a clock that moves only while the layer works:
    no machine's load decides) is timed until the runs settle (their interquartile range within 5% of their median),
    or the cap on runs or on seconds ends it first; the median of the runs taken is its cost."""
    clock = Clock()
    monkeypatch.setattr(profile, "_clock", lambda device: clock)
    backbone = nn.Sequential(Noisy(clock, Script(*UNTIMED, 5.0, 5.0, 1.0, 5.0, then=1.0)))
    (cost,) = profile_layers(backbone, torch.randn(2, 4), repeats=repeats)
    assert (cost.forward, cost.backward) == (forward, 2 * forward)
    runs = ([5.0, 5.0, 1.0, 5.0] + [1.0] * timed)[:timed]  # the timed forwards
    assert clock.now == UNTIMED[0] + 3 * sum(UNTIMED[1:]) + 3 * sum(runs)  # the in-place check runs no backward


def test_the_spread_of_runs_is_their_interquartile_range_over_their_median():
    from lightning_gpipe.planning.balance.repeats import relative_spread

    assert relative_spread([1.0]) == relative_spread([2.0, 2.0, 2.0]) == 0.0
    assert relative_spread([3.0, 15.0, 15.0]) == pytest.approx(6.0 / 15.0)  # quartiles 9 and 15, median 15
    assert relative_spread([0.0, 0.0, 1.0]) == math.inf
    with pytest.raises(ValueError, match=r"Repeats\(least=3, most=2, spread=0.05, budget=2.0\): give 1 <= least"):
        Repeats(least=3, most=2)
    with pytest.raises(ValueError, match=r"Repeats\(least=0, most=0"):
        Repeats.exactly(0)


def test_the_strategy_profiles_its_layers_as_the_pipeline_runs_them(monkeypatch):
    """``balance="time"`` under ``bf16-mixed`` with ``zb-h1``: each layer is profiled on one of the run's micro-batches
    (8 rows in 2), inside the precision plugin's autocast with the weights' casts cached as a step caches them, and
    with its backward split into B and W as the schedule runs it (what B keeps for W is a bf16 gradient); the autocast
    cache is left as it was."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_gpipe.lightning.measure import shared_layer_costs

    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((len(x), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            seen.append(torch.is_autocast_cache_enabled())
            return x

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(Timed(clock, 1.0), Probe(), Timed(clock, 3.0))
            self.example_input_array = torch.randn(8, 4)

        def forward(self, x):
            return self.backbone(x)

    clock = Clock()
    monkeypatch.setattr(profile, "_clock", lambda device: clock)
    position = SimpleNamespace(unbounded_phase=lambda what: nullcontext())
    strategy = SimpleNamespace(
        config=PipelineConfig(balance="time", schedule="zb-h1", chunks=2),
        layer_costs=None,
        topology=SimpleNamespace(num_stages=2),
        root_device=torch.device("cpu"),
        precision_plugin=MixedPrecision("bf16-mixed", "cpu"),
        job=SimpleNamespace(position=position),
        is_global_zero=True,
        broadcast=lambda value, src: value,
    )
    cached = torch.is_autocast_cache_enabled()
    first, _, last = shared_layer_costs(strategy, Module(), "backbone")
    assert torch.is_autocast_cache_enabled() == cached
    assert set(seen[0::2]) == {(4, True, torch.bfloat16)} and set(seen[1::2]) == {True}
    assert (first.forward, first.backward, first.input_grad, first.weight_grad) == (1.0, 2.0, 0.0, 2.0)  # on data: W
    assert (last.forward, last.input_grad) == (3.0, 6.0) and last.kept_grad_bytes == 4 * 4 * 2  # B keeps a bf16 grad


def test_the_profile_predicts_a_stage_s_busy_time_with_b_and_w_where_the_run_splits_its_backwards():
    """The profile's busy time per step of each stage, as the re-split's check predicts it: M times the forwards and
    backwards; where the run splits its backwards (zb-h1), a stage after the first runs each layer's profiled B and W
    (more than its whole backward), the first stage whole backwards. The check says what it predicted against what it
    measured, with the error, in its record and its line."""
    from lightning_gpipe.lightning.resplit import check_line, check_record, choose_resplit, profiled_busy

    profile = [LayerCost(1e-3, 2e-3, input_grad=1.5e-3, weight_grad=1.5e-3)] * 8
    assert profiled_busy(profile, [4, 4], 4, "never") == pytest.approx([48e-3, 48e-3])
    assert profiled_busy(profile, [4, 4], 4, "never", split=True) == pytest.approx([48e-3, 64e-3])
    config = PipelineConfig(balance="time", chunks=4, checkpoint="never", schedule="zb-h1")
    decision = choose_resplit(profile, [4, 4], [60e-3, 64e-3], config, 4)
    assert decision.profiled == pytest.approx([48e-3, 64e-3]) and not decision.taken
    record = check_record(decision, [60e-3, 64e-3], config.splits_backward)
    assert record["profile_error"] == pytest.approx([-0.2, 0.0]) and record["split_backward"]
    assert check_line(decision, [60e-3, 64e-3], 0.05).startswith(
        "GPipeStrategy keeps balance=[4, 4]: the stages' busy times (profiled 48.0, 64.0 ms per step against 60.0, 64.0"
        " ms measured, error -20%, +0%) predict no split 5% faster (the best split's step "
    )
