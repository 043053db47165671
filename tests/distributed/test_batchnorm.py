"""Deferred batch norm on 2 stage processes (tests/workers/batchnorm.py): a convolutional net against single-device
Lightning."""

import torch
from conftest import shared_run


def _compared(key: str, chunks: int, downstream: str) -> bool:
    """Everything with one micro-batch. With several: every batch norm's update count, and the running
    statistics of those whose input depends on the data only (not of the ``downstream`` one)."""
    attribute = key.rsplit(".", 1)[-1]
    return (
        chunks == 1
        or attribute == "num_batches_tracked"
        or (attribute.startswith("running_") and not key.startswith(downstream))
    )


TWO_STAGES = shared_run("batchnorm.py", devices=2, timeout=200)


def test_two_stages_match_single_device_lightning():
    tmp_path = TWO_STAGES()
    from workers.batchnorm import CONFIGS, DOWNSTREAM, fit

    references = {lr: fit(lr).state_dict() for lr in {lr for _, _, lr in CONFIGS.values()}}
    for name, (chunks, _, lr) in CONFIGS.items():
        expected, state = references[lr], torch.load(tmp_path / f"{name}.pt")
        assert list(state) == list(expected)
        for key in [key for key in expected if _compared(key, chunks, DOWNSTREAM)]:
            torch.testing.assert_close(state[key], expected[key], rtol=0, atol=1e-5, msg=f"{key}, {name}")
        for rank in range(2):  # the plain layers are back after fit, also on the meta device of rank 1
            types = (tmp_path / f"{name}_types_rank{rank}.txt").read_text().split()
            assert types == ["BatchNorm2d", "BatchNorm2d", "BatchNorm1d"], (name, rank)
