"""A step whose micro-batches mix shapes a stage has not seen (sent after their signature) with shapes it has (given
by the step message) trains as one device does: payloads are received in the order they were sent."""

import pytest
import torch
from conftest import assert_states_close, shared_run
from mixed_batches import fit

RUN = shared_run("mixed_shapes.py", devices=2, timeout=240)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_new_and_known_shapes_in_one_step_train_like_one_device(schedule):
    expected = fit().lightning_module.state_dict()
    assert_states_close(torch.load(RUN() / f"{schedule}.pt"), expected)


def test_channels_last_activations_and_their_gradients_cross_in_their_layout_and_train_like_one_device():
    """The boundary activation of a ``channels_last`` model crosses in that layout (announced by the step message or
    headed, as its micro-batches' shapes are known or new), and its gradient comes back in it, B and W apart."""
    expected = fit(images=True).lightning_module.state_dict()
    assert_states_close(torch.load(RUN() / "zb-h1.pt"), expected)
