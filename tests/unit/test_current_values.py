"""The values a run carries between splits (lightning_gpipe/lightning/current_values.py: state-dict entries and the
buffers no state dict holds) and a split's undo, which gives them back to the whole module
(lightning_gpipe/engine/partition.py), checked in this process (the runs: tests/distributed/test_split_changes.py)."""

import copy

import pytest
import torch
from torch import nn

from lightning_gpipe.engine.partition import Split
from lightning_gpipe.lightning.current_values import held_names, module_values


class Scaled(nn.Linear):
    """A Linear(2, 2) whose output is multiplied by a buffer no state dict holds."""

    def __init__(self, scale: float) -> None:
        super().__init__(2, 2)
        self.register_buffer("scale", torch.full((2,), scale), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(Scaled(0.5), Scaled(0.75))


def test_a_modules_values_are_its_state_dict_and_every_name_of_its_unsaved_buffers():
    """A buffer two modules share (as a Hugging Face model lends its rotary table to its layers) is a value under
    each name, as a shared parameter is a state-dict entry under each: a later run's split may hold it under either
    (under one name only, a stage that held it under the other found no process that kept it)."""
    table = torch.arange(2.0)
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    for layer in (first, second):
        layer.register_buffer("table", table, persistent=False)
    module = nn.Sequential(first, second)
    values = module_values(module)
    assert sorted(values) == ["0.bias", "0.table", "0.weight", "1.bias", "1.table", "1.weight"]
    assert values["0.table"] is table and values["1.table"] is table
    module[1].to("meta")
    assert held_names(module) == {"0.bias", "0.table", "0.weight"}


def test_undoing_a_split_gives_the_whole_module_every_stages_values_and_leaves_unnamed_ones_on_meta():
    """The other stage's layer comes back with its parameters and its unsaved buffer (before: to_empty's
    uninitialised memory); a buffer the gathered values lack stays on the meta device, where using it raises."""
    module = Net()
    whole = {name: value.detach().clone() for name, value in module_values(copy.deepcopy(module)).items()}
    Split(module, "backbone", [1, 1], 0).undo(whole)
    for name, value in module_values(module).items():
        torch.testing.assert_close(value, whole[name], atol=0, rtol=0, msg=name)
    module = Net()
    Split(module, "backbone", [1, 1], 0).undo({name: v for name, v in whole.items() if name != "backbone.1.scale"})
    assert module.backbone[1].scale.is_meta and not module.backbone[1].weight.is_meta
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        module.backbone(torch.ones(1, 2)).tolist()
