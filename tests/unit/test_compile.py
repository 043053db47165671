"""GPipeStrategy(compile=...) in one process (:mod:`lightning_gpipe.engine.compilation`): compiled layers give the
uncompiled run's gradients through the fill, the recompute and the drain, and through the B/W split; names stay;
bad values fail before any step. Two stages under ZB-H1: tests/distributed/test_compile.py."""

import copy

import pytest
import torch
from conftest import one_stage_pipeline
from models import FEATURES, TupleNet
from torch import nn
from torch._dynamo.utils import counters

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.compilation import compile_layers, compile_options, is_compiled, uncompile_layers
from lightning_gpipe.engine.weightgrad import backward_input

STATIC = {"dynamic": False}
"""Compile options of the tests: one graph per shape, no dynamic-shape analysis (faster to compile)."""


def _pipeline_grads(module: TupleNet, compiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One fill and drain of a one-stage pipeline, 3 recomputed micro-batches: the output and the gradients."""
    runtime = one_stage_pipeline(module, chunks=3, checkpoint="always")
    if compiled:
        compile_layers(runtime.model_chunks[0].partition, compile_options(STATIC))
    x = torch.randn(12, FEATURES, generator=torch.Generator().manual_seed(0))
    out = module.backbone((x, x > -1.0))
    module.head(out).pow(2).mean().backward()
    runtime.backward()
    return out.detach(), [p.grad.clone() for p in module.parameters()]


def test_a_compiled_one_stage_pipeline_with_recompute_equals_the_uncompiled_one():
    torch.manual_seed(0)
    plain = TupleNet(blocks=2)
    compiled = copy.deepcopy(plain)
    names = list(compiled.state_dict())
    expected_out, expected = _pipeline_grads(plain, compiled=False)
    counters.clear()
    out, grads = _pipeline_grads(compiled, compiled=True)
    layers = list(compiled.backbone.children())
    assert all(is_compiled(layer) for layer in layers)
    assert counters["frames"]["ok"] >= 2 * len(layers)  # each layer's fill (without autograd) and its recompute
    assert list(compiled.state_dict()) == names  # backbone.1.linear.weight stays backbone.1.linear.weight
    torch.testing.assert_close(out, expected_out, rtol=0, atol=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    uncompile_layers(compiled.backbone)
    assert not any(is_compiled(layer) or "forward" in vars(layer) for layer in layers)


def test_torch_layers_are_compiled_too_and_the_weight_gradient_split_gives_the_same_gradients():
    """``nn.Module.compile()`` leaves a torch layer (``nn.Sequential`` of ``nn.Linear``) uncompiled on torch 2.13; ours
    compiles it, its backward is one node, and B then W (weightgrad) run it for the input and the weights."""
    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)))
    compiled = copy.deepcopy(plain)
    compile_layers(compiled, compile_options(STATIC))
    x, grad = torch.randn(5, 8), torch.randn(5, 8)
    expected_input = torch.autograd.grad(plain(x.requires_grad_()), x, grad)[0]
    plain(x).backward(grad)
    leaf = x.detach().requires_grad_()
    y = compiled(leaf)
    assert type(y.grad_fn).__name__ == "CompiledFunctionBackward"
    weights = backward_input([y], [grad], [leaf])
    assert all(p.grad is None for p in compiled.parameters())  # B: the input gradient only
    torch.testing.assert_close(leaf.grad, expected_input, rtol=0, atol=1e-5)
    weights()  # W
    for got, want in zip(compiled.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("split_backward", [False, True])
def test_a_stage_that_splits_its_backwards_compiles_without_donated_buffers(split_backward):
    """A backward AOTAutograd compiled with donated buffers (here: the first one ran without keeping the graph)
    refuses B's ``retain_graph=True``; a splitting stage turns them off."""
    with torch._functorch.config.patch(donated_buffer=True):  # compile_layer changes it for the process
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 8)))
        compile_layers(layers, compile_options(STATIC), split_backward=split_backward)
        x = torch.randn(4, 8, requires_grad=True)
        layers(x).sum().backward()  # compiles the backward, with donated buffers unless turned off
        y = layers(x)
        if not split_backward:
            with pytest.raises(RuntimeError, match="donated buffers"):
                backward_input([y], [torch.ones_like(y)], [x])
            return
        backward_input([y], [torch.ones_like(y)], [x])()


def _dropout_run(checkpoint: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    module = nn.Module()
    module.backbone = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh()) for _ in range(2)))
    runtime = one_stage_pipeline(module, chunks=3, checkpoint=checkpoint)
    compile_layers(runtime.model_chunks[0].partition, compile_options(STATIC))
    x = torch.randn(12, 8)
    torch.manual_seed(5)
    out = module.backbone(x)
    out.pow(2).sum().backward()
    runtime.backward()
    return out.detach(), [p.grad for p in module.parameters()]


def test_a_compiled_recompute_replays_the_fills_dropout_masks():
    """Inductor draws its own masks, seeded from torch's generator, which the stage restores for the recompute."""
    expected_out, expected = _dropout_run("never")
    out, grads = _dropout_run("always")
    assert torch.equal(out, expected_out)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("value", ["yes", 1, None, {"bogus": 1}, ["dynamic"]])
def test_a_bad_compile_value_fails_before_any_step(value):
    with pytest.raises(ValueError, match="compile="):
        GPipeStrategy(compile=value)


def test_compile_options():
    assert compile_options(False) is None and compile_options(True) == {}
    assert compile_options({"dynamic": False, "mode": "default"}) == {"dynamic": False, "mode": "default"}


def test_on_a_torch_without_isolate_recompiles_each_layer_compiles_its_own_code(monkeypatch):
    """torch before 2.12 has no ``isolate_recompiles``: each layer's function then gets a code object of its own
    (Dynamo's cache lives there), and the option is not passed (its torch.compile would refuse it)."""
    from lightning_gpipe.engine import compilation

    given = []
    monkeypatch.setattr(compilation, "ISOLATES", False)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: given.append((fn, options)) or fn)
    compile_layers(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), {})
    (first, first_options), (second, second_options) = given
    assert first.__code__ is not second.__code__ and first.__code__ == second.__code__
    assert first_options == second_options == {}
