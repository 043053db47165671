"""Runs of one script on one module whose split changes from run to run: a stage that now holds layers another stage
trained computes with their trained values (:mod:`lightning_gpipe.lightning.current_values`), for a module created
whole and one created on the meta device. The worker: tests/workers/split_changes.py (2 processes, shared launch)."""

import pytest
import torch
from conftest import shared_run

RUNS = shared_run("split_changes.py", devices=2, timeout=300)


@pytest.fixture(scope="module")
def out():
    return RUNS()


def test_a_run_with_another_split_predicts_with_the_trained_values(out):
    """Fit split [3, 1], then predict split [1, 3] and [3, 1]: both equal the trained whole module's own output (before
    the fix, stage 1 predicted with layers 1 and 2's initial values: 0.71 off)."""
    got = torch.load(out / "whole.pt")
    for balance in ("[1, 3]", "[3, 1]"):
        torch.testing.assert_close(got["predicted"][balance], got["own"], atol=0, rtol=0)


def test_the_whole_module_after_fit_has_every_stages_buffers_that_no_state_dict_holds(out):
    """A buffer registered with ``persistent=False`` in a layer stage 1 held comes back to global rank 0 with its value
    (before the fix: uninitialised memory, ``to_empty``'s, e.g. 8.8e-29), and a stage that holds it in a later run
    computes with it (before: with its reset value, 1.0)."""
    got = torch.load(out / "whole.pt")
    expected = [torch.full((8,), 0.5 + 0.25 * index) for index in range(4)]
    torch.testing.assert_close(got["scales"], expected, atol=0, rtol=0)


def test_a_module_created_on_the_meta_device_keeps_its_trained_values_across_splits(out):
    """No process holds the whole module after fit; the layers a stage newly holds come from the stage that trained
    them: the prediction split [1, 3] equals the one split as in training."""
    got = torch.load(out / "meta.pt")
    torch.testing.assert_close(got["predicted"]["[1, 3]"], got["predicted"]["[3, 1]"], atol=0, rtol=0)
