"""Automatic balance: the memory-limited solver, the layer profiler, the modes (the strategy's choice on stage
processes: tests/distributed/test_balance.py)."""

import json
import statistics
import time
from itertools import combinations
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from models import TupleNet
from torch import nn

from lightning_gpipe import GPipeStrategy, PipelineBalance, balance_by, profile_layers, solve
from lightning_gpipe.engine import StageTrace, StepTrace
from lightning_gpipe.engine.events import Span
from lightning_gpipe.lightning.backbone import sample_micro_batch
from lightning_gpipe.lightning.callbacks.balance import format_table
from lightning_gpipe.planning.balance import LayerCost, layer_weights, resolve_balance, stage_sums


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
    """GPipeStrategy's option is balance_memory_limit (its memory_limit is the planner's); the error names it."""
    with pytest.raises(
        ValueError, match=r"within the balance's memory limit of 4 bytes \(GPipeStrategy\(balance_memory_limit="
    ):
        resolve_balance("memory", nn.Sequential(nn.Identity(), nn.Identity()), 2, [LayerCost(1.0, 1.0, 5)] * 2, 4)


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


class Repeated(nn.Module):
    """``times`` applications of one ``Linear(width, width)`` and tanh: its time grows with ``times``, not its size."""

    def __init__(self, width: int, times: int) -> None:
        super().__init__()
        self.linear, self.times = nn.Linear(width, width), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.linear(x))
        return x


@pytest.fixture
def one_thread():
    """One torch thread: on a shared 2-core machine two threads make every timing a scheduling lottery."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stage_seconds(stage: nn.Sequential, x: torch.Tensor) -> float:
    """CPU time of one forward and backward of ``stage``: its own work, whatever else the machine runs."""
    start = time.thread_time()
    out = stage(x)
    out.backward(torch.ones_like(out))
    return time.thread_time() - start


def test_time_balance_is_within_ten_percent_of_the_best_split(one_thread):
    """Layers whose work differs tenfold; the best split is found by timing every possible stage independently.

    The stages are re-timed here as whole stages, in interleaved rounds, by their CPU time (one thread): the
    time a dedicated core would take, since wall time on a shared machine also counts the moments other
    processes hold the core.
    """
    torch.manual_seed(0)
    backbone = nn.Sequential(*[Repeated(256, times) for times in (1, 1, 1, 10, 10, 10, 1, 1, 1)])
    sample, layers, stages = torch.randn(32, 256), len(backbone), 3
    chosen = balance_by("time", profile_layers(backbone, sample, repeats=5), stages)

    inputs = [sample]  # the input of every possible stage start; later stages receive one that requires grad
    with torch.no_grad():
        for layer in backbone[:-1]:
            inputs.append(layer(inputs[-1]).requires_grad_())
    spans = [(a, b) for a in range(layers) for b in range(a + 1, layers + 1)]
    rounds = {span: [] for span in spans}
    for _ in range(7):  # interleaved rounds, so a burst of load on the machine hits every stage alike
        for a, b in spans:
            rounds[(a, b)].append(_stage_seconds(backbone[a:b], inputs[a]))
    seconds = {span: statistics.median(times) for span, times in rounds.items()}

    def slowest(balance):
        bounds = [sum(balance[:i]) for i in range(len(balance) + 1)]
        return max(seconds[(a, b)] for a, b in zip(bounds, bounds[1:]))

    best = min(_splits(layers, stages), key=slowest)
    by_params = resolve_balance("params", backbone, stages)
    print(
        f"\ntenfold backbone, {stages} stages: time split {chosen} slowest stage {slowest(chosen) * 1e3:.2f} ms;"
        f" best split {best} {slowest(best) * 1e3:.2f} ms; params split {by_params} {slowest(by_params) * 1e3:.2f} ms"
    )
    assert slowest(chosen) <= 1.10 * slowest(best)


def test_a_layer_at_two_positions_is_profiled_at_each():
    """A module used at two backbone positions (tied) is one child but two layers: one cost per position, so that
    ``balance="time"`` and the schedules placed by cost see every layer."""
    shared = nn.Linear(4, 4)
    layers = nn.Sequential(shared, nn.Tanh(), shared)
    assert len(list(layers.named_children())) == 2 and len(layers) == 3
    costs = profile_layers(layers, torch.randn(8, 4), "cpu", repeats=1, warmup=0)
    assert len(costs) == 3 and costs[0].parameter_bytes == costs[2].parameter_bytes == 80


def _balance_report(tmp_path, balance: list[int], costs: list[LayerCost]) -> tuple[dict, str]:
    """``PipelineBalance``'s report and table after one measured step of two stages whose work differs threefold,
    the strategy holding the profiled ``costs`` (a trainer as the callback reads it)."""
    strategy = GPipeStrategy(balance=balance, chunks=2, checkpoint="always")
    strategy.layer_costs = costs
    trainer = SimpleNamespace(strategy=strategy, loggers=[], logger=None, default_root_dir=str(tmp_path), global_step=0)
    stages = [
        StageTrace(k, [Span("forward", i, 0.0, seconds) for i in range(2)], 0.0, 1.0, layers=n)
        for k, (n, seconds) in enumerate(zip(balance, (0.1, 0.3)))
    ]
    callback = PipelineBalance(warmup=0, steps=1)
    callback.on_step(trainer, StepTrace(0, stages))
    assert callback.report is not None
    return callback.report, format_table(callback.report)


def test_pipeline_balance_suggests_only_a_split_the_simulator_predicts_faster_and_by_how_much(tmp_path):
    """On these costs the solver's even split, [2, 2], is slower on the simulator than [3, 1] (the first stage's
    recomputes hide in its waits for gradients): from [3, 1] nothing is suggested; from [1, 3] the fastest split the
    search finds, [3, 1], is, with its speed-up."""
    costs = [LayerCost(5.0, 1.0), LayerCost(2.0, 4.0), LayerCost(5.0, 1.0), LayerCost(5.0, 8.0)]
    assert solve([2 * c.forward + c.backward for c in costs], 2) == [2, 2]

    report, table = _balance_report(tmp_path, [3, 1], costs)
    assert report["suggested_balance"] is None and report["best_balance"] == [3, 1]
    assert report["predicted_step_s"] == report["best_step_s"] == 66.0 and report["speedup"] == 1.0
    assert "suggested balance" not in table
    assert "no faster balance than [3, 1] found (from profiled layer costs; simulated step 66s;" in table

    report, table = _balance_report(tmp_path, [1, 3], costs)
    assert report["suggested_balance"] == [3, 1] and report["predicted_step_s"] == 80.0
    assert table.splitlines()[-1] == (
        "suggested balance=[3, 1] instead of [1, 3] (from profiled layer costs): simulated step 66s vs 80s,"
        " 1.21x as fast"
    )
    assert json.loads((tmp_path / "pipeline_balance.json").read_text()) == report


def test_the_balance_table_docs_observability_md_shows_is_the_callbacks_format():
    """docs/observability.md's PipelineBalance output, its figures put back into a report, is what the table prints."""
    linear = 1024 * 1024 + 1024

    def stage(k, layers, forward, backward, loss, waiting, mib):
        return {
            "stage": k, "layers": layers, "parameters": layers // 2 * linear, "forward": forward, "recompute": 0.0,
            "backward": backward, "loss": loss, "waiting": waiting, "activation_bytes": mib * 2**20,
        }  # fmt: skip

    report = {
        "steps": [1, 2, 3],
        "chunks": 8,
        "checkpoint": "never",
        "balance": [4, 12],
        "stages": [stage(0, 4, 0.1222, 0.1704, 0.0, 0.5665, 12), stage(1, 12, 0.3156, 0.6796, 0.0079, 0.0517, 28)],
        "imbalance": 1.55,
        "suggested_balance": [8, 8],
        "cost_source": "profiled layer costs",
        "predicted_step_s": 0.6123,
        "best_balance": [8, 8],
        "best_step_s": 0.4398,
        "speedup": 0.6123 / 0.4398,
    }
    docs = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text(encoding="utf-8")
    block = docs.split("```\nPipeline balance, mean per step")[1].split("\n```")[0]
    assert "Pipeline balance, mean per step" + block == format_table(report)
