"""timm models in the pipeline (lightning_gpipe.timm), distributed: the tiny model of every family of
tests/timm_families.py, fine-tuned by ``ImageClassifier`` through ``to_sequential`` (no user wrapper) on 2 stages,
trains like one device: under fill-drain with SGD (to 1e-5) and under 1F1B with AdamW (by the suite's fp32 rounding
rule), a ResNet and a Swin split by profiled time (``balance="time"``, each layer run alone); and a ViT on a
(2 stages x 2 replicas) mesh that FSDP2 shards over the replicas, with AdamW.

The runs are tests/workers/timm_models.py: every 2-stage case one after another in the shared 2-process launch, the
sharded one in the shared 4-process launch. The references train the same module on one device, each step's loss
computed in the pipeline's micro-batches (batch norm's statistics are per micro-batch in both).
"""

from functools import cache

import pytest
import torch
from conftest import assert_states_close, assert_within_fp32_rounding, shared_run
from timm_families import FAMILIES, one_device

RUNS = shared_run("timm_models.py", devices=2, timeout=600)
"""Every family under fill-drain and 1F1B (tests/workers/timm_models.py's ``CASES``)."""

SHARDED = shared_run("timm_models.py", "--sharded", devices=4, timeout=300)
"""The ViT on a sharded (2 x 2) mesh."""


@cache
def _one_device(family: str, optimizer: str, dtype=torch.float32, replicated=False) -> dict[str, torch.Tensor]:
    return one_device(family, optimizer, dtype, replicated)


def _parameters(path, expected: dict) -> dict[str, torch.Tensor]:
    """The parameters of a run's state dict (its batch norm buffers left out, see the module docstring)."""
    state = torch.load(path)
    return {name: state[name].float() for name in expected}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_like_one_device_under_fill_drain_with_sgd(family):
    expected = _one_device(family, "sgd")
    assert_states_close(_parameters(RUNS() / f"{family}_gpipe.pt", expected), expected)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_trains_like_one_device_under_1f1b_with_adamw(family):
    expected = _one_device(family, "adamw")
    got = _parameters(RUNS() / f"{family}_1f1b.pt", expected)
    assert_within_fp32_rounding(got, expected, lambda: _one_device(family, "adamw", torch.float64))


def test_a_vit_trains_sharded_over_two_replicas_of_two_stages_like_one_device():
    expected = _one_device("vit", "adamw", replicated=True)
    got = _parameters(SHARDED() / "vit_sharded.pt", expected)
    assert_within_fp32_rounding(got, expected, lambda: _one_device("vit", "adamw", torch.float64, replicated=True))
