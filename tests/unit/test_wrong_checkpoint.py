"""Checkpoints of another model and damaged ones, in one process: the whole-model check's message is torch's, an
optimizer state without a parameter's entries is refused, and a damaged file is named (resumes on 2 stages:
tests/distributed/test_wrong_checkpoint.py)."""

import os
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from lightning_gpipe.lightning.consolidate import consolidated_checkpoint
from lightning_gpipe.lightning.state_dict import (
    METADATA,
    DamagedCheckpointError,
    check_model_state,
    load_optimizer_state,
    model_shapes,
    optimizer_state,
    reading,
)


class Stack(nn.Module):
    """``depth`` linear layers of ``width`` features, then a head: the state-dict keys of a pipelined model."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(4 if i == 0 else width, width) for i in range(depth)])
        self.head = nn.Linear(width, 2)


@pytest.mark.parametrize("strict", [True, False])
def test_the_whole_model_check_says_what_torch_says(strict):
    model = Stack(3, 8)
    state = Stack(2, 8).state_dict()  # shallower ...
    state["backbone.1.weight"] = torch.zeros(6, 8)  # ... with a narrower layer ...
    state["neck.weight"] = torch.zeros(1)  # ... and a module the model has not
    with pytest.raises(RuntimeError) as torch_says:
        model.load_state_dict(state, strict=strict)
    with pytest.raises(RuntimeError) as we_say:
        check_model_state(state, model_shapes(model), strict, "Stack")
    assert str(we_say.value) == str(torch_says.value)
    assert ('Missing key(s) in state_dict: "backbone.2.weight"' in str(we_say.value)) is strict


def test_an_optimizer_state_without_a_parameters_entries_is_refused_naming_it():
    shallower, model = Stack(2, 8), Stack(3, 8)
    saved = optimizer_state(shallower, torch.optim.SGD(shallower.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"no optimizer state of backbone\.2\.weight, backbone\.2\.bias: it was"):
        load_optimizer_state(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), saved)


def test_an_empty_checkpoint_file_is_named(tmp_path):
    empty = tmp_path / "empty.ckpt"
    empty.touch()
    message = re.escape(f"The checkpoint file {empty} is damaged or truncated: it is empty")
    with pytest.raises(DamagedCheckpointError, match=message):
        with reading(empty):
            TorchCheckpointIO().load_checkpoint(empty)


def test_a_truncated_metadata_file_of_a_sharded_checkpoint_is_named(tmp_path):
    directory = tmp_path / "sharded.ckpt"
    with pytest.warns(UserWarning, match="assuming the intent is to save in a single process"):
        dcp.save({"state_dict": Stack(2, 8).state_dict()}, checkpoint_id=directory)
    torch.save({"epoch": 0}, directory / METADATA)
    metadata = directory / ".metadata"
    os.truncate(metadata, os.path.getsize(metadata) // 2)
    message = re.escape(f"The checkpoint file {metadata} is damaged or truncated: its data ends at byte")
    with pytest.raises(DamagedCheckpointError, match=message):
        consolidated_checkpoint(directory)
