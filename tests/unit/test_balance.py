"""Automatic balance: the memory-limited solver, the layer profiler, the modes (the strategy's choice on stage
processes: tests/distributed/test_balance.py)."""

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
from lightning_gpipe.planning.balance import LayerCost, layer_weights, profile, resolve_balance, stage_sums


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
    from lightning_gpipe.lightning.resplit import Resplit, choose_resplit, measured_costs

    profile = [LayerCost(1e-3, 2e-3, parameter_bytes=10)] * 8  # every layer alike: balance="time" splits [4, 4]
    config, measured = PipelineConfig(balance="time", chunks=2), [11e-3, 4e-3]  # stage 0 measured 2.75x stage 1
    scaled = measured_costs(profile, [4, 4], measured, 2, "except_last")
    share = 0.5  # except_last at M = 2: one of the two forwards recomputed
    assert [2 * sum(c.forward * (1 + share) + c.backward for c in stage) for stage in (scaled[:4], scaled[4:])] == (
        pytest.approx(measured)  # each stage's layers add up to its measured time
    )
    assert [c.forward / scaled[-1].forward for c in scaled[:4]] == pytest.approx([2.75] * 4)
    assert [c.parameter_bytes for c in scaled] == [10] * 8  # memory as profiled
    decision = choose_resplit(profile, [4, 4], measured, config, 2)
    assert decision.taken and decision.best == [3, 5] and decision.best_step < 0.95 * decision.step
    limited = PipelineConfig(balance="time", chunks=2, balance_memory_limit=40)  # no stage may hold 5 layers
    assert not choose_resplit(profile, [4, 4], measured, limited, 2).taken
    assert not choose_resplit(profile, [4, 4], [4.2e-3, 4e-3], config, 2).taken  # under 5% faster: kept
    with pytest.raises(ValueError, match=r"Resplit\(warmup=3, steps=0, gain=0.05\): give warmup >= 0 .* steps >= 1"):
        Resplit(steps=0)


def test_a_stage_is_busy_in_its_forwards_recomputes_and_backwards_not_its_loss_optimizer_or_waits():
    from lightning_gpipe.engine import Span
    from lightning_gpipe.lightning.resplit import work_seconds

    kinds = ["forward", "recv", "loss", "recompute", "backward", "weight", "send", "optimizer"]
    spans = [Span(kind, 0, float(i), i + 0.5 * (i + 1)) for i, kind in enumerate(kinds)]
    assert work_seconds(None, spans) == pytest.approx(0.5 + 2.0 + 2.5 + 3.0)  # the default time source
