"""A LightningModule's backbone: finding it (:func:`find_backbone`), and profiling it in place: finding a sample
micro-batch, then measuring each layer, and what runs after the backbone.

The backbone input is not the batch: ``training_step`` prepares it first (data preparation
only, see the user contract). To get it without running anything that holds parameters,
the backbone is swapped for a stand-in that records its input and stops the step there.
What runs after the backbone (head, loss) is measured likewise, with a stand-in that returns
an output of the backbone's shape (:func:`after_backbone`).
"""

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_gpipe._torch import tree_leaves
from lightning_gpipe.engine import Value, batch_size, materialize, scatter
from lightning_gpipe.lightning._lightning import collect_rng_states, set_rng_states, training_dataloaders
from lightning_gpipe.lightning.contract import BackboneReached
from lightning_gpipe.lightning.per_micro_batch import batch_rows, split_batch
from lightning_gpipe.planning import AfterBackbone, LayerCost, ProfiledCosts, profile_layers, profile_sizes


def find_backbone(module: nn.Module, name: str | None = None) -> str:
    """Name of the attribute of ``module`` that holds the ``nn.Sequential`` backbone (the ``backbone`` option).

    Args:
        module: the LightningModule.
        name: the attribute name given by the user, or ``None`` to find the only ``nn.Sequential`` child.

    Raises:
        ValueError: if there is no backbone, several candidates, or ``name`` is not an ``nn.Sequential``.
    """
    if name is not None:
        found = getattr(module, name, None)
        if not isinstance(found, nn.Sequential):
            raise ValueError(
                f"GPipeStrategy(backbone={name!r}): `{type(module).__name__}.{name}` is"
                f" {type(found).__name__ if found is not None else 'missing'}, not an nn.Sequential. Put the layers to"
                " pipeline in an nn.Sequential attribute and name it with `backbone=`."
            )
        return name
    candidates = [child for child, value in module.named_children() if isinstance(value, nn.Sequential)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential attribute to pipeline. Put the layers to split into"
            " stages in one, e.g. `self.backbone = nn.Sequential(...)`."
        )
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential attributes ({', '.join(candidates)}); choose the one"
        f" to pipeline with `GPipeStrategy(backbone={candidates[0]!r})`."
    )


class _InputRecorder(nn.Module):
    """Stands for the backbone: keeps its input, then ends the step."""

    def forward(self, value: Value) -> None:
        self.value = value
        raise BackboneReached


def profile_backbone(
    module: LightningModule, backbone: str, micro_batches: int, device: torch.device, split: bool = False
) -> list[LayerCost]:
    """Measure each backbone layer on the first micro-batch of a sample batch (see :func:`sample_micro_batch`);
    with ``split``, also its backward's B and W halves (:func:`profile_layers`).

    Random number generators (torch, CUDA, NumPy, Python) are left as they were, so profiling
    changes neither the data order nor the training.

    Args:
        module: the LightningModule, attached to a Trainer, before the backbone is split.
        backbone: attribute name of its ``nn.Sequential`` backbone.
        micro_batches: M, the number of micro-batches per mini-batch.
        device: where to run the layers, one at a time.

    Raises:
        ValueError: if there is no sample, RuntimeError if the sample call does not reach the backbone
            (see :func:`sample_micro_batch`); TypeError or ValueError from :func:`profile_layers`.
    """
    with unchanged_random_state():
        sample = sample_micro_batch(module, backbone, micro_batches)
        return profile_layers(getattr(module, backbone), sample, device, split=split)


@contextmanager
def unchanged_random_state() -> Iterator[None]:
    """Leave the random number generators (torch, CUDA, NumPy, Python) as they were before the block."""
    states = collect_rng_states()
    try:
        yield
    finally:
        set_rng_states(states)


def sample_micro_batch(module: LightningModule, backbone: str, micro_batches: int) -> Value:
    """The first of ``micro_batches`` micro-batches of a backbone input the module really produces (see
    :func:`sample_backbone_input`)."""
    return scatter(sample_backbone_input(module, backbone), micro_batches)[0]


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
    if batch is None and example is not None:
        return _backbone_input(module, backbone, lambda: _call_forward(module, example), "forward")
    batch = batch if batch is not None else first_training_batch(module)
    return _backbone_input(module, backbone, lambda: module.training_step(batch, 0), "training_step")


def first_training_batch(module: LightningModule) -> Any:
    """The first batch of the training data, moved to the device with the user's transfer hooks.

    Raises:
        ValueError: if the Trainer is not fitting.
    """
    trainer = module.trainer
    if trainer.state.fn != TrainerFn.FITTING:
        raise ValueError(
            "Profiling the backbone to choose `balance` needs a sample: outside `trainer.fit` it takes the module's"
            " `example_input_array` (the input of `forward`); set it, or give `balance` as a list of layer counts."
        )
    batch, _, _ = next(iter(CombinedLoader(training_dataloaders(trainer), "max_size_cycle")))
    return trainer.strategy.batch_to_device(batch)


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
    micro_batches: int | None = None,
    split: bool = False,
) -> ProfiledCosts:
    """:func:`~lightning_gpipe.planning.profiling.profile_sizes` of ``module``'s backbone ``backbone`` on the backbone
    input its step really produces (:func:`sample_backbone_input`: ``training_step`` on ``batch``, else
    ``example_input_array``, else the first training batch). The random number generators are left unchanged.

    Raises:
        ValueError, RuntimeError: as :func:`sample_backbone_input`.
    """
    with unchanged_random_state():
        if batch is None and module.example_input_array is None:
            batch = first_training_batch(module)
        value = sample_backbone_input(module, backbone, batch)
        with after_backbone(module, backbone, batch, batch_size(value), device) as after:
            return profile_sizes(getattr(module, backbone), value, device, micro_batches, split, after)


@contextmanager
def after_backbone(
    module: LightningModule, backbone: str, batch: Any, rows: int, device: torch.device | str
) -> Iterator[AfterBackbone | None]:
    """What runs after the backbone in ``module``'s ``training_step`` on ``batch`` (whose backbone input has ``rows``
    rows), for the planner to measure (:class:`~lightning_gpipe.planning.profiling.AfterBackbone`, its loss from
    :func:`_loss_after`); ``None`` without a batch (a sample from ``example_input_array`` has no step to run).

    Inside the block the modules outside the backbone are copies in training mode on ``device`` (initialised there if
    they were on the meta device), so that the module's own (its metrics' states, its parameters' gradients) are left
    as they were.
    """
    if batch is None:
        yield None
        return
    inside = set(getattr(module, backbone).modules())
    originals = {name: child for name, child in module.named_children() if child not in inside}
    copies = {name: _copy_on(child, device) for name, child in originals.items()}
    try:
        for name, child in copies.items():
            setattr(module, name, child)
        parameters = [t for child in copies.values() for t in (*child.parameters(), *child.buffers())]
        existing = [t for t in tree_leaves(batch) if isinstance(t, Tensor)]
        yield AfterBackbone(partial(_loss_after, module, backbone, batch), parameters, existing, _rows(batch) == rows)
    finally:
        for name, child in originals.items():
            setattr(module, name, child)


def _copy_on(child: nn.Module, device: torch.device | str) -> nn.Module:
    """A copy of ``child`` in training mode on ``device``, initialised there if it was on the meta device."""
    replica = copy.deepcopy(child)
    materialize(replica, torch.device(device))
    return replica.to(device).train()


def _rows(batch: Any) -> int | None:
    """The rows of ``batch`` if its tensors share them in dim 0 (it splits into micro-batches), else ``None``."""
    try:
        return batch_rows(batch)
    except (TypeError, ValueError):
        return None


class _OutputGiver(nn.Module):
    """Stands for the backbone: returns ``output`` (the backbone's output on the step's rows) whatever its input."""

    def __init__(self, output: Value) -> None:
        super().__init__()
        self.output, self.called = output, False

    def forward(self, value: Value) -> Value:
        self.called = True
        return self.output


class _LastScalar(TorchFunctionMode):
    """Keeps the last one-element tensor with a gradient that a torch function returns inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.tensor: Tensor | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and out.numel() == 1 and out.requires_grad:
            self.tensor = out
        return out


def _loss_after(module: LightningModule, backbone: str, batch: Any, micro_batches: int, output: Value) -> Tensor | None:
    """The loss of ``training_step`` on the first of ``micro_batches`` micro-batches of ``batch`` (1: all of it, as
    under fill-drain), the backbone returning ``output``, with ``self.log`` recording nothing: the Tensor it returns,
    or a dict's ``"loss"``. If the step returns none, or raises after the backbone call (it may need what only a
    running Trainer has, such as ``self.trainer.optimizers`` before they exist), the last one-element tensor with a
    gradient it computed.

    Raises:
        Exception: what the step raises before the backbone call, or after it without a loss computed.
    """
    part = batch if micro_batches == 1 else split_batch(batch, micro_batches)[0]
    original, stand_in = getattr(module, backbone), _OutputGiver(output)
    setattr(module, backbone, stand_in)
    module.__dict__["log"] = lambda *args, **kwargs: None  # `log_dict` calls it too
    try:
        with _LastScalar() as last:
            try:
                result = module.training_step(part, 0)
            except Exception:
                if not stand_in.called or last.tensor is None:
                    raise
                return last.tensor
    finally:
        setattr(module, backbone, original)
        module.__dict__.pop("log", None)
    loss = result.get("loss") if isinstance(result, Mapping) else result
    return loss if isinstance(loss, Tensor) else last.tensor
