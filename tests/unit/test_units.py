"""In-process checks of micro-batching, balance, partitioning, argument errors and the one-stage engine."""

import pytest
import torch
from conftest import one_stage_pipeline
from models import TupleNet  # noqa: E402
from torch import nn

from lightning_gpipe import GPipeStrategy, solve
from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.lightning.backbone import find_backbone
from lightning_gpipe.planning.balance import resolve_balance


def test_split_is_uneven_like_tensor_split_and_repeats_non_tensors():
    x, mask = torch.arange(10).reshape(10, 1), torch.ones(10, 2, dtype=torch.bool)
    parts = microbatch.scatter((x, mask, "keep"), 4)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    assert all(p[2] == "keep" for p in parts)
    joined = microbatch.gather(parts)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], mask) and joined[2] == "keep"


def test_split_never_makes_empty_micro_batches():
    assert [p.shape[0] for p in microbatch.scatter(torch.zeros(3, 5), 8)] == [1, 1, 1]


def test_split_rejects_mismatched_batch_sizes_and_tensorless_values():
    with pytest.raises(ValueError, match="same batch size in dim 0"):
        microbatch.scatter((torch.zeros(4, 2), torch.zeros(3, 2)), 2)
    with pytest.raises(TypeError, match="Expected a Tensor or a tuple holding tensors"):
        microbatch.scatter(("a", 1), 2)


@pytest.mark.parametrize(
    "costs, stages, expected",
    [([1] * 8, 2, [4, 4]), ([1, 1, 1, 10], 2, [3, 1]), ([5, 1, 1, 1, 1, 1], 2, [1, 5]), ([1, 2, 3], 3, [1, 1, 1])],
)
def test_solver_minimises_the_costliest_stage(costs, stages, expected):
    assert solve(costs, stages) == expected


def test_solver_is_optimal_against_brute_force():
    from itertools import combinations

    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
        for cuts in combinations(range(1, len(costs)), 2)
    )
    balance = solve(costs, 3)
    bounds = [sum(balance[:i]) for i in range(4)]
    assert max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])) == best


def test_solver_rejects_more_stages_than_layers():
    with pytest.raises(ValueError, match="Cannot split 2 layers into 3 non-empty stages"):
        solve([1, 1], 3)


class TwoSequentials(TupleNet):
    def __init__(self):
        super().__init__()
        self.extra = nn.Sequential(nn.Linear(2, 2))


def test_backbone_is_found_or_the_error_names_the_fix():
    assert find_backbone(TupleNet()) == "backbone"
    with pytest.raises(
        ValueError, match=r"several nn.Sequential attributes \(backbone, extra\).*GPipeStrategy\(backbone="
    ):
        find_backbone(TwoSequentials())
    with pytest.raises(ValueError, match="has no nn.Sequential attribute"):
        find_backbone(nn.Module())
    with pytest.raises(ValueError, match=r"`TupleNet.head` is Linear, not an nn.Sequential"):
        find_backbone(TupleNet(), "head")


@pytest.mark.parametrize(
    "balance, message",
    [
        ([2, 2, 4], r"has 3 stages but the pipeline has 2 devices"),
        ([0, 8], r"leaves a stage empty"),
        ([3, 4], r"sums to 7 but the backbone has 8 layers"),
    ],
)
def test_bad_balance_is_refused(balance, message):
    backbone = TupleNet().backbone
    assert resolve_balance([3, 5], backbone, 2) == [3, 5]
    with pytest.raises(ValueError, match=message):
        resolve_balance(balance, backbone, 2)


def test_default_balance_evens_out_parameters_and_needs_enough_layers():
    backbone = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 10))
    assert resolve_balance(None, backbone, 2) == [2, 3]
    with pytest.raises(ValueError, match="fewer than the 6 stages"):
        resolve_balance(None, backbone, 6)
    with pytest.raises(ValueError, match=r"fewer than the 6 virtual stages \(virtual_stages=3\); use fewer devices or"):
        resolve_balance(None, backbone, 6, virtual_stages=3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(chunks=0), "chunks is the number of micro-batches, an integer >= 1"),
        (dict(chunks=2.5), "chunks is the number of micro-batches"),
        (dict(checkpoint="sometimes"), "choose one of always, except_last, never"),
        (dict(balance="3,5"), "as a list of integers"),
        (dict(start_method="fork"), "choose 'popen' or 'spawn'"),
        (dict(state_dict_type="deepspeed"), "choose 'full' or 'sharded'"),
    ],
)
def test_bad_strategy_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(**kwargs)


def test_split_keeps_names_frees_other_stages_and_undoes():
    module = TupleNet()
    full = {k: v.clone() for k, v in module.state_dict().items()}
    split = Split(module, "backbone", [3, 5], stage_index=0)
    assert list(module.state_dict()) == [f"backbone.{i}.linear.{p}" for i in range(3) for p in ("weight", "bias")]
    assert all(p.is_meta for p in split.sequential[5].parameters())
    with pytest.raises(RuntimeError, match="`self.head` was called on stage 0, before the backbone call"):
        module.head(torch.zeros(1, 16))
    split.undo(full)
    assert module.backbone is split.sequential
    for key, value in module.state_dict().items():
        assert torch.equal(value, full[key])


def test_last_stage_keeps_modules_outside_the_backbone():
    module = TupleNet()
    Split(module, "backbone", [3, 5], stage_index=1)
    assert set(module.state_dict()) == {
        *(f"backbone.{i}.linear.{p}" for i in range(3, 7) for p in ("weight", "bias")),
        "head.weight",
        "head.bias",
    }


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return nn.functional.dropout(torch.tanh(self.linear(x)), 0.5)


def _one_stage_grads(checkpoint: str, chunks: int):
    torch.manual_seed(0)
    layers = nn.Sequential(*[Noisy() for _ in range(3)])
    module = nn.Module()
    module.backbone = layers
    schedule = one_stage_pipeline(module, chunks, checkpoint)
    torch.manual_seed(1)
    x = torch.randn(10, 8)
    out = module.backbone(x)
    out.pow(2).sum().backward()
    schedule.backward()
    return out.detach(), [p.grad for p in layers.parameters()]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recompute_replays_dropout_and_gives_the_same_gradients(checkpoint):
    expected_out, expected_grads = _one_stage_grads("never", 4)
    out, grads = _one_stage_grads(checkpoint, 4)
    assert torch.equal(out, expected_out)
    for got, expected in zip(grads, expected_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_one_stage_equals_plain_backward():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(9, 8)
    layers(x).pow(2).sum().backward()
    expected = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    module = nn.Module()
    module.backbone = layers
    schedule = one_stage_pipeline(module, 4, "always")
    module.backbone(x).pow(2).sum().backward()
    schedule.backward()
    for p, g in zip(layers.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-5)


def test_materialize_keeps_a_parameter_tied_on_one_stage_one_parameter():
    from lightning_gpipe.engine.partition import materialize

    with torch.device("meta"):
        embedding, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    head.weight = embedding.weight
    holder = nn.ModuleDict({"embedding": embedding, "head": head})
    materialize(holder, torch.device("cpu"))
    assert holder["head"].weight is holder["embedding"].weight and not holder["head"].weight.is_meta


class _Table(nn.Linear):
    """A Linear(2, 2) with a saved and an unsaved buffer computed in ``__init__``; its reset fills the weights, and
    the buffers only with ``fills``."""

    def __init__(self, fills: bool) -> None:
        super().__init__(2, 2)
        self.fills = fills
        self.register_buffer("table", torch.arange(2.0) + 1, persistent=False)
        self.register_buffer("steps", torch.arange(2) + 1)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "fills", False):
            self.table.copy_(torch.arange(2.0) + 1)
            self.steps.copy_(torch.arange(2) + 1)


def test_materialize_refuses_an_unsaved_buffer_its_reset_leaves_unwritten_and_poisons_the_rest():
    """Before: each stage computed with `to_empty`'s memory in both buffers. An unsaved buffer can only come from the
    reset, so one it does not write raises naming it; a saved one may still come from a checkpoint, so it holds a
    value no initialisation writes (an int64's smallest; NaN for floating point) instead of leftovers."""
    from lightning_gpipe.engine.partition import materialize

    with torch.device("meta"):
        filled, unfilled = nn.Sequential(_Table(fills=True)), nn.Sequential(_Table(fills=False))
    materialize(filled, torch.device("cpu"))
    assert filled[0].table.tolist() == [1.0, 2.0] and filled[0].steps.tolist() == [1, 2]
    with pytest.raises(ValueError, match=r"`0\.table`, a buffer registered with persistent=False, .* Fill it in"):
        materialize(unfilled, torch.device("cpu"))
    assert unfilled[0].table.isnan().all() and unfilled[0].steps.tolist() == [torch.iinfo(torch.int64).min] * 2


def test_the_strategy_takes_every_option_of_the_config_with_its_default():
    import dataclasses
    import inspect

    from lightning_gpipe.lightning.config import PipelineConfig

    signature = inspect.signature(GPipeStrategy).parameters
    for field in dataclasses.fields(PipelineConfig):
        assert signature[field.name].default == field.default, field.name
