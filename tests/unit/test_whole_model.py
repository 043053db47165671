"""A module that keeps the whole model beside its backbone: each stage holds only what it runs, its summary counts
that, and a module of the last stage read early works where harmless (lightning_gpipe/engine/partition.py)."""

import pytest
import torch
from contract_models import KeepsWholeModel, SomeNet, held_parameters
from torch import nn

from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.ties import find_ties
from lightning_gpipe.lightning.summary import _local_part, _merge

BALANCE = [2, 3]


def numel(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def test_each_stage_holds_only_its_layers_and_the_last_the_head():
    whole = KeepsWholeModel()
    blocks, head = whole.model.blocks, (whole.model.norm, whole.model.fc)
    expected = [numel(*blocks[:2]), numel(*blocks[2:], *head)]
    assert sum(expected) == held_parameters(whole) and find_ties(whole, "backbone", BALANCE) == []
    parts, keys = [], set()
    for stage in (0, 1):
        module = KeepsWholeModel()
        split = Split(module, "backbone", BALANCE, stage_index=stage)
        assert held_parameters(module) == expected[stage]
        keys |= set(module.state_dict())
        assert not any(t.is_meta for t in module.state_dict().values())  # nothing another stage holds is reachable
        parts.append(_local_part(module, split.partition, stage, 1, holds_head=stage == 1))
        if stage == 1:
            assert module.model.blocks is module.backbone  # the backbone, wherever the module refers to it
            assert [name for name, _ in module.named_parameters()][:2] == [
                "model.blocks.2.weight",
                "model.blocks.2.bias",
            ]
    table, summaries = _merge(parts)
    assert [s.parameters for s in summaries] == expected and table.total == held_parameters(whole)
    assert keys == set(whole.state_dict())  # the stages' state dicts together are the whole module's


def test_undo_puts_the_whole_model_back():
    module = KeepsWholeModel()
    full = {k: v.clone() for k, v in module.state_dict().items()}
    split = Split(module, "backbone", BALANCE, stage_index=1)
    split.undo({k: v.clone() for k, v in full.items()})
    assert module.model.blocks is module.backbone is split.sequential
    assert all(torch.equal(v, full[k]) for k, v in module.state_dict().items())


def test_a_container_holding_the_layers_elsewhere_gets_placeholders_for_other_stages_layers():
    class ListNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = ListNet()
            self.backbone = nn.Sequential(*self.model.layers)
            self.head = nn.Linear(4, 2)

    module = Holder()
    assert find_ties(module, "backbone", [2, 2]) == []
    Split(module, "backbone", [2, 2], stage_index=1)
    assert held_parameters(module) == numel(module.backbone, module.head)
    assert module.model.layers[2] is module.backbone.get_submodule("2")
    with pytest.raises(RuntimeError, match=r"`self.model.layers.0` was called on stage 1, which does not hold it"):
        module.model.layers[0](torch.zeros(1, 4))


def test_a_last_stage_module_read_before_the_backbone_call_works_where_harmless():
    module = KeepsWholeModel()
    Split(module, "backbone", BALANCE, stage_index=0)
    assert module.model.num_classes == SomeNet().num_classes  # a plain value: the real one
    forward_head = module.model.forward_head  # read before the backbone call, as `forward_head(self.backbone(x))`
    with pytest.raises(RuntimeError) as called:
        forward_head(torch.zeros(1, 32))
    assert str(called.value).startswith("`self.model.forward_head` was called on stage 0, before the backbone call.")
    assert "use `self.model.forward_head` after the backbone call" in str(called.value)
    assert getattr(module.model.fc, "weight", None) is None  # missing here, as a module's absent tensor always was
    with pytest.raises(AttributeError, match=r"`self.model.fc.weight` was read on stage 0, before the backbone call"):
        module.model.fc.weight  # noqa: B018
    with pytest.raises(RuntimeError, match=r"`self.model.norm` was called on stage 0, before the backbone call"):
        module.model.norm(torch.zeros(1, 32))
    with pytest.raises(AttributeError, match="'SomeNet' object has no attribute 'missing'"):
        module.model.missing  # noqa: B018


def test_the_backbone_under_a_second_name_is_the_stages_part_there_too():
    class Aliased(KeepsWholeModel):
        def __init__(self):
            super().__init__()
            self.features = self.backbone

    whole = Aliased()
    keys = set()
    for stage in (0, 1):
        module = Aliased()
        Split(module, "backbone", BALANCE, stage_index=stage)
        assert module.features is module.backbone
        keys |= set(module.state_dict())
    assert keys == set(whole.state_dict()) and find_ties(whole, "backbone", BALANCE) == []
