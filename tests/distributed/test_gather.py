"""The union of every stage's state on global rank 0 (what a ``"full"`` checkpoint and the module after fit are
made of): each value as the stage that holds it last has it, whatever its dtype and shape. The worker:
tests/workers/gather.py (2 processes, shared launch)."""

import torch
from conftest import shared_run

RUN = shared_run("gather.py", devices=2, timeout=300)


def test_the_union_of_every_stages_dict_holds_each_value_as_its_last_holder_has_it():
    """Dense tensors cross as their own bytes (bf16, int64, bool, a 0-d and an empty one, a non-contiguous view), other
    values pickled, and a name both stages hold comes from stage 1, in the order the dicts name them."""
    gathered = torch.load(RUN() / "gathered.pt", weights_only=False)
    got, expected = gathered["got"], gathered["expected"]
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert (got[key].dtype, got[key].shape) == (value.dtype, value.shape), key
            torch.testing.assert_close(got[key], value, atol=0, rtol=0)
        else:
            assert got[key] == value, key
    torch.testing.assert_close(got["shared.weight"], torch.full((3,), 1.0), atol=0, rtol=0)
