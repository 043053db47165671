"""Activation offload (lightning_gpipe/engine/offload.py) in one process: a step with it equals one without it bit for
bit, in every re-materialization mode and across the B/W split; its hooks move what they should (bytes counted by an
injected counter) and the plan's prefetches cover every micro-batch moved; the note on a CPU. Against one device on
two stages: tests/distributed/test_one_f_one_b.py ("offload_*")."""

import pytest
import torch
from torch import Tensor, nn

from lightning_gpipe.engine import COMPUTE, plans
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.offload import ActivationOffload, placement
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.pipeline import Runtime
from lightning_gpipe.engine.transfer import Link
from lightning_gpipe.engine.weightgrad import backward_input
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.config import PipelineConfig, offload_note

WIDTH, ROWS = 16, 8


class Scaled(nn.Module):
    """``x * weight``: autograd saves the parameter itself, which offload must leave where it is."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        return x * self.weight


def backbone() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(0.2), nn.Linear(WIDTH, WIDTH), nn.ReLU(), Scaled()
    )


def one_stage_step(checkpoint: str, offload: ActivationOffload | None) -> tuple[Tensor, list]:
    """One fill-drain step of a one-stage pipeline of 4 micro-batches: the loss and the parameters' gradients."""
    module = nn.Module()
    module.backbone = backbone()
    split = Split(module, "backbone", [len(module.backbone)], stage_index=0)
    chunk = ModelChunk(split.partition, Link(None, None, torch.device("cpu"), job=Job()), 0, 1, 4, checkpoint, False)
    chunk.offload = offload
    runtime = Runtime([chunk], "gpipe", 1)
    torch.manual_seed(1)
    y = runtime.forward(torch.randn(ROWS, WIDTH))
    loss = (y**2).mean()
    loss.backward()
    runtime.backward()
    return loss, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_offload_equals_no_offload_bit_for_bit_in_every_checkpoint_mode(checkpoint):
    moved: list[int] = []
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, counter=moved.append)
    loss, grads = one_stage_step(checkpoint, offload)
    expected_loss, expected_grads = one_stage_step(checkpoint, None)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    assert offload.late == 0  # every micro-batch moved was prefetched where the plan placed it
    # micro-batches 0 to 2 of 4 (2 rows each) wait for their backward; the last one's follows its forward at once.
    # Each moves 4 tensors of 2 x WIDTH floats: Tanh's output, Dropout's scaled mask (a float tensor on a CPU), its
    # output (the next linear layer's input) and ReLU's, apart from the stage's input and output; not the parameter
    # Scaled saves nor the weights' views the linear layers save, nor twice ReLU's output (saved by ReLU and Scaled).
    # Micro-batch 0 also moves the copy of its input its first layer saved: the stage's first training forward runs
    # on a copy, to learn whether the layers modify their input (Partition.run). A re-materialized micro-batch saves
    # nothing in its forward, and its recompute's saved tensors are used at once.
    assert moved == ([2 * WIDTH * 4] * (4 * 3 + 1) if checkpoint == "never" else [])


def test_tiny_tensors_stay_on_the_device():
    moved: list[int] = []
    offload = ActivationOffload(torch.device("cpu"), min_bytes=2 * WIDTH * 4 + 1, counter=moved.append)
    loss, _ = one_stage_step("never", offload)
    assert moved == [] and torch.equal(loss, one_stage_step("never", None)[0])


@pytest.mark.parametrize("prefetched", [True, False])
def test_the_weight_gradient_of_the_split_unpacks_the_offloaded_tensors_again(prefetched):
    """B (retain_graph) and W both unpack the saved tensors: the same values, whether the prefetch ran or not."""

    def split_backward(offload: ActivationOffload | None) -> list[Tensor]:
        layers = backbone().train()
        x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(2)).requires_grad_()
        torch.manual_seed(3)
        if offload is None:
            y = layers(x)
        else:
            with offload.saving() as handles:
                y = layers(x)
            offload.keep(0, handles, (x, y))
            if prefetched:
                offload.prefetch(0)
        weight = backward_input([y], [torch.ones_like(y)], [x])
        gradients = [x.grad.clone()]
        weight()
        return gradients + [p.grad for p in layers.parameters()]

    moved: list[int] = []
    offload = ActivationOffload(torch.device("cpu"), min_bytes=0, counter=moved.append)
    got, expected = split_backward(offload), split_backward(None)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert len(moved) == 4 and offload.late == (0 if prefetched else 4)


@pytest.mark.parametrize("schedule, defer", [("gpipe", False), ("gpipe", True), ("1f1b", False), ("zb-h1", True)])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_each_prefetch_comes_one_computing_action_before_the_first_that_backpropagates(schedule, defer, checkpoint):
    for plan in plans(schedule, 2, 8, checkpoint, defer, 1, None):
        computing = [(n, a) for n, a in enumerate(plan.actions) if a.kind in COMPUTE and a.micro_batch is not None]
        where = placement(plan)
        prefetched = [key for keys in where.prefetch.values() for key in keys]
        assert sorted(prefetched) == sorted(where.offloaded)  # each offloaded micro-batch comes back once
        for number, keys in where.prefetch.items():
            position = next(p for p, (n, _) in enumerate(computing) if n == number)
            (model_chunk, micro_batch), following = *keys, computing[position + 1][1]
            assert (following.model_chunk, following.micro_batch) == (model_chunk, micro_batch)
            assert following.kind.value in ("loss", "recompute", "backward")
            forward = next(p for p, (_, a) in enumerate(computing) if a.micro_batch == micro_batch)
            assert forward < position  # the micro-batch waits in host memory through one computing action at least
    last = placement(plans("1f1b", 2, 8, "never", False, 1, None)[1])
    assert not last.offloaded  # 1F1B's last stage: each backward follows its forward at once


def test_a_bad_value_names_the_choice_and_the_cpu_says_offload_moves_nothing():
    with pytest.raises(ValueError, match=r"offload='all'\): choose None \(activations stay on the device\) or"):
        PipelineConfig(offload="all")  # type: ignore[arg-type]  # the bad value under test
    note = offload_note(PipelineConfig(offload="activations"), "cpu")
    assert note is not None and "offload on the CPU moves nothing anywhere useful" in note
    assert offload_note(PipelineConfig(offload="activations"), "cuda") is None
    assert offload_note(PipelineConfig(), "cpu") is None
