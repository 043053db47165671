"""The backward split into input gradient (B) and deferred weight gradient (W) equals one plain backward."""

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.weightgrad import backward_input, run_together


class SharedTwice(nn.Module):
    """One Linear used twice, a LayerNorm between: two branch nodes of one weight, one below the other."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.linear(torch.tanh(self.norm(self.linear(x))))


class ParameterOutput(nn.Module):
    """A second output that depends on a parameter only (no path to the input)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear, self.table = nn.Linear(8, 8), nn.Parameter(torch.randn(5, 8))

    def forward(self, x):
        return self.linear(x), self.table * 2


class TwoInTwoOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y):
        hidden = self.a(x) + y
        return self.b(hidden), hidden * 3


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), [(5, 8)]),
    "shared weight": (SharedTwice, [(5, 8)]),
    "parameter-only output": (ParameterOutput, [(5, 8)]),
    "two inputs and outputs": (TwoInTwoOut, [(5, 8), (5, 8)]),
    "transformer layer with dropout": (
        lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True, norm_first=True),
        [(3, 7, 16)],
    ),
    "convolution and batch norm": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)),
        [(2, 3, 8, 8)],
    ),
}


def _forward(model: nn.Module, shapes) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(1)  # the same inputs and dropout masks for every run
    inputs = [torch.randn(*shape).requires_grad_() for shape in shapes]
    output = model(*inputs)
    return inputs, list(output) if isinstance(output, tuple) else [output]


@pytest.mark.parametrize("name", MODELS)
def test_input_then_weight_gradient_equals_one_backward(name):
    make, shapes = MODELS[name]
    torch.manual_seed(0)
    model = make()
    inputs, outputs = _forward(model, shapes)
    grads = [torch.randn_like(o) for o in outputs]
    torch.autograd.backward(outputs, grads)
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected_inputs = [x.grad for x in inputs]
    model.zero_grad(set_to_none=True)

    inputs, outputs = _forward(model, shapes)
    weight = backward_input(outputs, grads, inputs)
    assert all(p.grad is None for p in model.parameters())  # B computed no weight gradient
    for x, want in zip(inputs, expected_inputs):
        torch.testing.assert_close(x.grad, want, rtol=0, atol=1e-6)
    weight()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-6, atol=1e-6, msg=n)
    with pytest.raises(RuntimeError, match="already computed"):
        weight()


def test_weight_gradients_accumulate_and_fire_parameter_hooks():
    model = nn.Linear(8, 8)
    fired = []
    model.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    inputs, outputs = _forward(model, [(4, 8)])
    grads = [torch.ones_like(outputs[0])]
    backward_input(outputs, grads, inputs)()
    first = model.weight.grad.clone()
    inputs, outputs = _forward(model, [(4, 8)])
    backward_input(outputs, grads, inputs)()
    torch.testing.assert_close(model.weight.grad, 2 * first)
    assert len(fired) == 2  # through the parameter's own AccumulateGrad, as a plain backward (DDP relies on it)


@pytest.mark.parametrize("name", MODELS)
def test_several_micro_batches_weight_gradients_at_once_equal_one_backward_each(name):
    make, shapes = MODELS[name]
    torch.manual_seed(0)
    model = make()
    rows = (5, 3, 4)  # uneven micro-batches
    micro_batches = [[(n, *shape[1:]) for shape in shapes] for n in rows]
    grads = []
    for micro in micro_batches:
        inputs, outputs = _forward(model, micro)
        grads.append([torch.randn_like(o) for o in outputs])
        torch.autograd.backward(outputs, grads[-1])
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    weights = []
    for micro, grad in zip(micro_batches, grads):
        inputs, outputs = _forward(model, micro)
        weights.append(backward_input(outputs, grad, inputs))
    run_together(weights)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-6, msg=n)
    fused = [p for p in model.parameters() if sum(q is p for q in fired) == 1]
    if name == "mlp":  # both linear layers: one product over the 12 rows, so each hook fires once
        assert len(fused) == 4
    if name == "shared weight":  # one Linear used twice: a group of two branch nodes, run per micro-batch
        assert not fused
    with pytest.raises(RuntimeError, match="already computed"):
        run_together(weights)


def test_several_micro_batches_weight_gradients_save_nothing_for_a_backward():
    """The stacked rows of a fused W are values: no graph keeps every layer's until the call ends."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    weights, kept = [], []  # the outputs stay alive, as a stage keeps them until W
    for rows in (5, 3):
        x = torch.randn(rows, 8, requires_grad=True)
        y = model(x)
        weights.append(backward_input([y], [torch.ones_like(y)], [x]))
        kept.append(y)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        run_together(weights)
    assert saved == []
    assert all(p.grad is not None for p in model.parameters())


def test_fused_weight_gradients_reach_autograd_in_bounded_calls(monkeypatch):
    """A stage whose products exceed PRODUCTS_IN_FLIGHT hands them to autograd in several calls, equal to one."""
    from lightning_gpipe.engine import weightgrad

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    x = [torch.randn(5, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)]
    for micro in x:
        model(micro).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(weightgrad, "PRODUCTS_IN_FLIGHT", 2 * 8 * 8 * 4)  # two layers' weight products
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: calls.append(a) or backward(*a, **k))
    weights = []
    for micro in x:
        y = model(micro)
        weights.append(backward_input([y], [torch.ones_like(y)], [micro]))
    calls.clear()
    run_together(weights)
    assert len(calls) == 2  # layers 1-2, then 3-4
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
