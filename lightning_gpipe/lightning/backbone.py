"""Profiling a LightningModule's backbone in place: finding a sample micro-batch, then measuring each layer.

The backbone input is not the batch: ``training_step`` prepares it first (data preparation
only, see the user contract). To get it without running anything that holds parameters,
the backbone is swapped for a stand-in that records its input and stops the step there.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import nn

from lightning_gpipe.engine import Value, scatter
from lightning_gpipe.lightning._lightning import collect_rng_states, set_rng_states, training_dataloaders
from lightning_gpipe.lightning.contract import BackboneReached
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.profile import profile_layers
from lightning_gpipe.planning.costs import ProfiledCosts
from lightning_gpipe.planning.profiling import profile_sizes


class _InputRecorder(nn.Module):
    """Stands for the backbone: keeps its input, then ends the step."""

    def forward(self, value: Value) -> None:
        self.value = value
        raise BackboneReached


def profile_backbone(
    module: LightningModule, backbone: str, chunks: int, device: torch.device, split: bool = False
) -> list[LayerCost]:
    """Measure each backbone layer on the first micro-batch of a sample batch (see :func:`sample_micro_batch`);
    with ``split``, also its backward's B and W halves (:func:`profile_layers`).

    Random number generators (torch, CUDA, NumPy, Python) are left as they were, so profiling
    changes neither the data order nor the training.

    Args:
        module: the LightningModule, attached to a Trainer, before the backbone is split.
        backbone: attribute name of its ``nn.Sequential`` backbone.
        chunks: M, the number of micro-batches per mini-batch.
        device: where to run the layers, one at a time.

    Raises:
        ValueError: if there is no sample, RuntimeError if the sample call does not reach the backbone
            (see :func:`sample_micro_batch`); TypeError or ValueError from :func:`profile_layers`.
    """
    with unchanged_random_state():
        sample = sample_micro_batch(module, backbone, chunks)
        return profile_layers(getattr(module, backbone), sample, device, split=split)


@contextmanager
def unchanged_random_state() -> Iterator[None]:
    """Leave the random number generators (torch, CUDA, NumPy, Python) as they were before the block."""
    states = collect_rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def sample_micro_batch(module: LightningModule, backbone: str, chunks: int) -> Value:
    """The first of ``chunks`` micro-batches of a backbone input the module really produces (see
    :func:`sample_backbone_input`)."""
    return scatter(sample_backbone_input(module, backbone), chunks)[0]


def sample_backbone_input(module: LightningModule, backbone: str, batch: Any = None) -> Value:
    """A whole mini-batch of backbone input the module really produces.

    The input comes from calling ``training_step`` on ``batch`` if it is given, else from calling the module on its
    ``example_input_array`` (Lightning's convention: the input of ``forward``, passed as ``forward(*x)`` for a tuple
    and ``forward(**x)`` for a dict) if it is set, else from calling ``training_step`` on the first batch of the
    training data (moved to the device with the user's transfer hooks) when fitting. Each call stops at the
    backbone, under ``torch.no_grad()``.

    Raises:
        ValueError: if there is neither ``batch`` nor ``example_input_array`` and the Trainer is not fitting.
        RuntimeError: if the call returns without calling the backbone.
    """
    example = module.example_input_array
    if batch is not None:
        return _backbone_input(module, backbone, lambda: module.training_step(batch, 0), "training_step")
    if example is not None:
        return _backbone_input(module, backbone, lambda: _call_forward(module, example), "forward")
    return _backbone_input(module, backbone, _first_training_step(module), "training_step")


def _first_training_step(module: LightningModule) -> Callable[[], Any]:
    trainer = module.trainer
    if trainer.state.fn != TrainerFn.FITTING:
        raise ValueError(
            "Profiling the backbone to choose `balance` needs a sample: outside `trainer.fit` it takes the module's"
            " `example_input_array` (the input of `forward`); set it, or give `balance` as a list of layer counts."
        )
    batch, _, _ = next(iter(CombinedLoader(training_dataloaders(trainer), "max_size_cycle")))
    batch = trainer.strategy.batch_to_device(batch)
    return lambda: module.training_step(batch, 0)


def _backbone_input(module: LightningModule, backbone: str, call: Callable[[], Any], name: str) -> Value:
    original = getattr(module, backbone)
    recorder = _InputRecorder()
    setattr(module, backbone, recorder)
    try:
        with torch.no_grad():
            call()
    except BackboneReached:
        return recorder.value
    finally:
        setattr(module, backbone, original)
    raise RuntimeError(
        f"`{name}` returned without calling `self.{backbone}`, so there is no sample to profile the backbone on;"
        f" call the backbone from `{name}` or give `balance` as a list of layer counts."
    )


def _call_forward(module: LightningModule, example: Any) -> Any:
    if isinstance(example, tuple):
        return module(*example)
    if isinstance(example, dict):
        return module(**example)
    return module(example)


def profile_module(
    module: LightningModule,
    backbone: str,
    device: torch.device | str,
    batch: Any = None,
    chunks: int | None = None,
    split: bool = False,
) -> ProfiledCosts:
    """:func:`~lightning_gpipe.planning.profiling.profile_sizes` of ``module``'s backbone ``backbone`` on the backbone
    input its step really produces (:func:`sample_backbone_input`: ``training_step`` on ``batch``, else
    ``example_input_array``, else the first training batch). The random number generators are left unchanged.

    Raises:
        ValueError, RuntimeError: as :func:`sample_backbone_input`.
    """
    with unchanged_random_state():
        value = sample_backbone_input(module, backbone, batch)
        return profile_sizes(getattr(module, backbone), value, device, chunks, split)
