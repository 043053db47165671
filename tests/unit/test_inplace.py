"""Layers that modify their input in place, at a stage's input and in the profile, and the profile's errors naming
the layer (lightning_gpipe/engine/microbatch.py's Partition.run, lightning_gpipe/planning/balance/profile.py)."""

import pytest
import torch
from contract_models import InplaceResNet
from torch import nn

from lightning_gpipe import profile_layers
from lightning_gpipe.engine.microbatch import Partition, leaves
from lightning_gpipe.engine.skip.tracker import SkipTracker


class AddOneInPlace(nn.Module):
    """Modifies its input in place, and not idempotently: a re-run on a modified input would show."""

    def forward(self, x):
        return x.add_(1.0)


class SecondReluInPlace(nn.Module):
    """Takes a tuple and modifies its second tensor in place."""

    def forward(self, value):
        a, b = value
        return a * 2, b.relu_()


def test_a_stage_input_modified_in_place_stays_a_leaf_with_the_exact_gradient():
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    partition = Partition({"3": AddOneInPlace(), "4": nn.ReLU(inplace=True), "5": linear})
    x = torch.randn(6, 4)
    received = leaves(x)  # as a stage receives it: a leaf that requires grad
    for _ in range(2):  # run again (a re-materialization): the input is unchanged, so is the output
        output = partition.run(received, kept=True)
        output.sum().backward()
    assert partition.modifies_input is True
    assert torch.equal(received, x)
    reference = x.clone().requires_grad_()
    linear((reference + 1).relu()).sum().backward()
    torch.testing.assert_close(output, linear((x + 1).relu()), rtol=0, atol=0)
    torch.testing.assert_close(received.grad, 2 * reference.grad, rtol=0, atol=0)  # two runs accumulated


def test_layers_that_do_not_modify_their_input_run_on_it_without_a_copy():
    partition = Partition({"0": nn.Identity()})
    x = leaves(torch.randn(3, 2))
    partition.run(x, kept=True)  # the first run finds out, on a copy
    assert partition.modifies_input is False
    assert partition.run(x, kept=True) is x


def test_a_tuple_input_modified_in_place_stays_unchanged():
    partition = Partition({"0": SecondReluInPlace()})
    a, b = torch.randn(5, 2), torch.randn(5, 2)
    value = leaves((a, b))
    out_a, out_b = partition.run(value, kept=True)
    (out_a.sum() + out_b.sum()).backward()
    assert torch.equal(value[1], b) and torch.equal(value[1].grad, (b > 0).float())
    assert torch.equal(value[0].grad, torch.full_like(a, 2.0))


def test_layers_that_start_modifying_their_input_later_are_refused_by_name():
    class Sometimes(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x.add_(1.0) if self.calls > 1 else x + 1

    partition = Partition({"7": Sometimes()})
    x = torch.zeros(2, 2)
    partition.run(x, kept=True)
    with torch.no_grad(), pytest.raises(RuntimeError, match="Backbone layers 7 modified their input in place"):
        partition.run(x, kept=True)


def test_a_received_skip_tensor_is_popped_as_a_copy_the_layer_may_modify():
    stashed = torch.randn(4, 3)
    received = leaves(stashed)
    popped = SkipTracker({("ns", "skip"): received}).load(("ns", "skip"))
    popped.relu_().sum().backward()
    assert torch.equal(received, stashed) and torch.equal(received.grad, (stashed > 0).float())


def test_the_profile_runs_in_place_layers_and_leaves_the_sample_unchanged():
    module = InplaceResNet()
    sample = torch.randn(4, 3, 16, 16)
    before = sample.clone()
    costs = profile_layers(module.backbone, sample, repeats=1, warmup=0)
    assert len(costs) == len(module.backbone) and all(cost.forward > 0 for cost in costs)
    assert torch.equal(sample, before)


def test_a_failing_layer_is_named_in_the_profiles_error():
    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("shapes disagree")

    layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), Broken())
    with pytest.raises(ValueError, match=r"Profiling backbone layer 2 \(Broken\) failed: ValueError: shapes disagree"):
        profile_layers(layers, torch.randn(2, 4), repeats=1, warmup=0)
