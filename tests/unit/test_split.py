"""The default's choice between whole backwards and the B/W split (lightning_gpipe/planning/split.py)."""

import pytest

from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.measure import split_line
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.split import MIN_GAIN, choose_split

BIG = LayerCost(forward=0.010, backward=0.020, activation_bytes=1000, input_grad=0.010, weight_grad=0.011)
"""A layer whose work dwarfs the engine's cost per action: the split fills the drain's bubble with W."""
TINY = LayerCost(forward=1e-5, backward=2e-5, activation_bytes=10, input_grad=2e-5, weight_grad=2e-5)
"""A layer whose B and W together cost twice its backward, and far less than the engine's cost per action."""


def test_the_split_is_chosen_where_it_is_predicted_faster_and_whole_backwards_where_not():
    big = choose_split([BIG] * 8, [4, 4], micro_batches=8, checkpoint="never")
    assert big.split and big.divided * (1 + MIN_GAIN) <= big.whole
    assert f"({big.whole / big.divided:.2f}x)" in big.reason
    tiny = choose_split([TINY] * 8, [4, 4], micro_batches=8, checkpoint="never")
    assert not tiny.split and tiny.divided > tiny.whole / (1 + MIN_GAIN)
    assert "defer_weight_grad=True (the B/W split)" in split_line(big)
    assert "whole backwards (defer_weight_grad=False)" in split_line(tiny)


def test_without_measured_b_and_w_or_over_the_memory_limit_the_backwards_stay_whole():
    unmeasured = LayerCost(forward=0.010, backward=0.020, activation_bytes=1000)
    assert not choose_split([unmeasured] * 8, [4, 4], 8, "never").split
    kept = LayerCost(**{**BIG.__dict__, "kept_grad_bytes": 500})
    assert choose_split([kept] * 8, [4, 4], 8, "never", memory_limit=4 * 1500).split  # 4 x (1000 + 500) fits
    over = choose_split([kept] * 8, [4, 4], 8, "never", memory_limit=4 * 1500 - 1)
    assert not over.split and "exceed the memory limit of 5,999 bytes" in over.reason


@pytest.mark.parametrize(
    "options, chooses",
    [
        ({}, True),
        ({"checkpoint": "never", "chunks": 8, "balance": "time"}, True),
        ({"defer_weight_grad": False}, False),
        ({"defer_weight_grad": True}, False),
        ({"schedule": "gpipe"}, False),
        ({"schedule": "1f1b"}, False),
        ({"plan": "auto", "memory_limit": 2**30}, False),
    ],
)
def test_the_choice_is_made_only_where_the_user_fixed_neither_schedule_nor_split(options, chooses):
    assert PipelineConfig(**options).chooses_split is chooses
