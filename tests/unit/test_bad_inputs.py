"""The table of bad inputs (docs/contract.md, "Bad inputs"): each gets an error that names the fix.

Here the arguments and the engine's checks, in this process. The mistakes that only show once the stages start
(tests/distributed/test_bad_inputs.py) and those that fail one stage in the middle of a step
(tests/distributed/test_failures.py) run on stage processes.
"""

from datetime import timedelta

import pytest
import torch
from torch import nn

from lightning_gpipe import GPipeStrategy, forward_and_share
from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.microbatch import Partition
from lightning_gpipe.lightning.contract import BackboneCall

ARGUMENTS = {
    "chunks_zero": (dict(chunks=0), "chunks is the number of micro-batches, an integer >= 1"),
    "chunks_float": (dict(chunks=2.5), "chunks is the number of micro-batches, an integer >= 1"),
    "checkpoint_mode": (dict(checkpoint="sometimes"), "choose one of always, except_last, never"),
    "balance_mode": (dict(balance="speed"), "choose 'params', 'time' or 'memory', or give the number of"),
    "balance_items": (dict(balance=[2, "3"]), "as a list of integers, e.g. balance=[3, 5]"),
    "memory_limit": (dict(balance_memory_limit=0), "give the bytes one stage may hold, an integer >= 1"),
    "memory_limit_with_list": (dict(balance=[4, 4], balance_memory_limit=10), "use balance='time'"),
    "start_method": (dict(start_method="fork"), "choose 'popen' or 'spawn'"),
    "state_dict_type": (dict(state_dict_type="distributed"), "choose 'full' or 'sharded'"),
    "stall_timeout_seconds": (dict(stall_timeout=30), "as a positive `datetime.timedelta`, e.g. timedelta(minutes=5)"),
    "stall_timeout_zero": (dict(stall_timeout=timedelta(0)), "as a positive `datetime.timedelta`"),
    "schedule": (dict(schedule="zb-2p"), "choose 'gpipe' (fill-drain), '1f1b' (one forward, one backward), 'zb-h1'"),
    "schedule_v": (dict(schedule="v-third"), "'v-min', 'v-half' or 'v-zb' (a V holding a third, a half or all of"),
    "zb-v chunks": (dict(schedule="zb-v", virtual_stages=3), "a V schedule places two model chunks per stage in a V"),
    "v-min chunks": (dict(schedule="v-min", virtual_stages=1), "schedule='v-min', virtual_stages=1): a V schedule"),
    "v_half_without_split": (dict(schedule="v-half", defer_weight_grad=False), "schedule='v-half', defer_weight_grad"),
    "virtual_stages_zero": (dict(virtual_stages=0), "give the model chunks per stage, an integer >= 1"),
    "zb_h1_without_split": (
        dict(schedule="zb-h1", defer_weight_grad=False),
        "a zero-bubble schedule runs each weight gradient apart from its input gradient, so it needs the B/W split;"
        " leave defer_weight_grad unset (or True), or choose schedule='1f1b'",
    ),
    "zb_1p_without_split": (dict(schedule="zb-1p", defer_weight_grad=False), "schedule='zb-1p', defer_weight_grad"),
    "defer_weight_grad": (dict(defer_weight_grad="yes"), "give True (the B/W split), False, or None for the"),
    "timeout_seconds": (
        dict(timeout=30),
        "give the process group's timeout as a positive `datetime.timedelta`, e.g."
        " timedelta(minutes=30) (timedelta(seconds=30) for 30 s)",
    ),
    "timeout_zero": (dict(timeout=timedelta(0)), "give the process group's timeout as a positive `datetime.timedelta`"),
    "deferred_batch_norm": (dict(deferred_batch_norm="yes"), "give True (batch norm's running statistics updated"),
    "backbone_type": (dict(backbone=3), "give the name of the nn.Sequential attribute as a string, or None"),
    "backend_type": (dict(process_group_backend=1), "give a backend name as a string, or None"),
    "cost_model_type": (dict(plan="auto", cost_model="fast"), "give a lightning_gpipe.CostModel, e.g. CostModel("),
    "offload": (dict(offload="weights"), "GPipeStrategy(offload='weights'): choose None (activations stay on the"),
}


@pytest.mark.parametrize("case", ARGUMENTS)
def test_a_bad_argument_names_the_fix(case):
    kwargs, fix = ARGUMENTS[case]
    with pytest.raises(ValueError) as raised:
        GPipeStrategy(**kwargs)
    assert fix in str(raised.value)


class _Returns(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


LAYERS = {
    "dict": (lambda x: {"h": x}, TypeError, "Backbone layer 1 (_Returns) returned a dict; layers of a pipelined"),
    "scalar": (
        lambda x: x.sum(),
        ValueError,
        "Backbone layer 1 (_Returns) returned a 0-dimensional tensor; activations carry the batch in dim 0",
    ),
    "scalar_in_tuple": (
        lambda x: (x, x.mean()),
        ValueError,
        "returned a 0-dimensional tensor at position 1 of its tuple; activations carry the batch in dim 0, so every"
        " tensor a backbone layer returns needs one row per sample. Keep the batch dimension",
    ),
}


@pytest.mark.parametrize("case", LAYERS)
def test_a_layer_returning_a_non_activation_is_named_before_any_concatenation(case):
    fn, error, message = LAYERS[case]
    partition = Partition({"0": nn.Linear(4, 4), "1": _Returns(fn)})
    with pytest.raises(error) as raised:
        partition.run(torch.zeros(3, 4))
    assert message in str(raised.value)


class _Schedule:
    """Counts the pipelined forwards a backbone call starts (each would send or receive on real stages)."""

    def __init__(self) -> None:
        self.forwards = 0

    def forward(self, value):
        self.forwards += 1
        return value


def test_a_second_backbone_call_fails_at_once_before_any_transfer():
    schedule = _Schedule()
    call = BackboneCall(schedule, is_last=True)
    with pytest.raises(RuntimeError, match="`training_step` called the pipelined backbone a second time in one step"):
        call.user_step("training_step", lambda: (call(torch.zeros(2, 4)), call(torch.zeros(2, 4))))
    assert schedule.forwards == 1


def test_a_step_without_a_backbone_call_names_the_fix():
    call = BackboneCall(_Schedule(), is_last=True)
    with pytest.raises(RuntimeError, match="did not call the pipelined backbone;.*Call `self.backbone"):
        call.user_step("validation_step", lambda: None)


def test_forward_and_share_after_the_plain_call_or_with_gradients_names_the_fix():
    call = BackboneCall(_Schedule(), is_last=True)
    partition = Partition({"0": nn.Identity()})
    partition.backbone_call = call
    with pytest.raises(RuntimeError, match="call it under `torch.no_grad\\(\\)`"):
        forward_and_share(partition, torch.zeros(2, 4), lambda y: y)

    def plain_then_shared():
        partition(torch.zeros(2, 4))
        with torch.no_grad():
            forward_and_share(partition, torch.zeros(2, 4), lambda y: y)

    with pytest.raises(RuntimeError, match="call the backbone plainly last, or only through `forward_and_share`"):
        call.user_step("validation_step", plain_then_shared)


def test_a_backbone_input_without_a_shared_batch_dimension_names_the_rule():
    with pytest.raises(ValueError, match="needs the same batch size in dim 0; got shapes \\[\\(4, 2\\), \\(\\)\\]"):
        microbatch.scatter((torch.zeros(4, 2), torch.tensor(1.0)), 2)
