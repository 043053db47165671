"""Models users bring train on 2 stages as on one device: a torchvision-style ResNet with ``ReLU(inplace=True)``
starting a stage, at every cut and with ``balance="time"``, and a module that keeps the whole model, whose stages
each hold only their own parameters (tests/workers/brought_models.py)."""

import json

import lightning as L
import pytest
import torch
from conftest import assert_states_close, shared_run
from contract_models import InplaceResNet, KeepsWholeModel, held_parameters, images
from models import loader, trainer_kwargs

RUN = shared_run("brought_models.py", devices=2, timeout=400)


def one_device(model, data):
    """A ``model()`` trained 3 steps on one device, as the worker trains it on 2 stages; its state dict."""
    L.seed_everything(1, verbose=False)
    module = model()
    L.Trainer(devices=1, max_steps=3, **trainer_kwargs()).fit(module, data)
    return module.state_dict()


@pytest.fixture(scope="module")
def resnet_state():
    return one_device(InplaceResNet, images())


@pytest.mark.parametrize("cut", range(1, 7))
def test_in_place_layers_train_equal_to_one_device_at_every_cut(cut, resnet_state):
    assert_states_close(torch.load(RUN() / f"resnet_cut{cut}.pt"), resnet_state)


def test_in_place_layers_train_equal_to_one_device_with_a_profiled_balance(resnet_state):
    assert_states_close(torch.load(RUN() / "resnet_time.pt"), resnet_state)


def test_a_module_keeping_the_whole_model_holds_on_each_stage_only_its_part_and_trains_equal():
    whole = KeepsWholeModel()
    blocks, head = whole.model.blocks, (whole.model.norm, whole.model.fc)
    expected = [sum(p.numel() for m in part for p in m.parameters()) for part in (blocks[:2], [*blocks[2:], *head])]
    assert sum(expected) == held_parameters(whole)
    for rank in (0, 1):
        recorded = json.loads((RUN() / f"held_rank{rank}.json").read_text())
        assert recorded == {"held": expected[rank], "summary": expected}
    assert_states_close(torch.load(RUN() / "whole.pt"), one_device(KeepsWholeModel, loader(rows=24, batch_size=8)))
