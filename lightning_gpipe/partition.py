"""Split a LightningModule's ``nn.Sequential`` backbone into stages, keeping parameter names.

Stage k keeps layers ``sum(balance[:k])`` to ``sum(balance[:k+1]) - 1`` under their
original names, so ``backbone.7.weight`` stays ``backbone.7.weight`` and the union
of the stages' state dicts is the full model's. Other stages' layers go to the
meta device (their memory is freed, their structure kept so that the split can
be undone). Modules outside the backbone that hold parameters or buffers (heads,
losses with weights) live on the last stage only; earlier stages hold a
placeholder that names the contract if user code calls it.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_gpipe.balance import LayerCost

Value = Union[Tensor, tuple]


class Partition(nn.Module):
    """The backbone layers of one stage, under their original names.

    Calling it runs the pipeline through the attached :class:`~lightning_gpipe.stage.Stage`
    (see :meth:`attach`); :meth:`run` applies the local layers to one micro-batch.

    Args:
        layers: ordered mapping of original names (``"7"``) to layers.
    """

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        super().__init__()
        for name, layer in layers.items():
            self.add_module(name, layer)
        self.stage = None

    def attach(self, stage) -> None:
        """Make calling this module run ``stage.forward`` (the pipeline) instead of the local layers alone."""
        self.stage = stage

    def forward(self, value: Value) -> Value:
        """Run the pipeline on the backbone input ``value``; see :class:`lightning_gpipe.stage.Stage`."""
        return self.stage.forward(value) if self.stage is not None else self.run(value)

    def run(self, value: Value) -> Value:
        """Apply the local layers in order to one micro-batch.

        Raises:
            TypeError: if a layer returns anything but a Tensor or a tuple of Tensors.
        """
        for name, layer in self._modules.items():
            value = layer(value)
            if not _is_activation(value):
                raise TypeError(
                    f"Backbone layer {name} ({type(layer).__name__}) returned {_describe(value)}; layers of a"
                    " pipelined backbone must return a Tensor or a tuple of Tensors."
                )
        return value


class _Freed(nn.Module):
    """Stands for a module that lives on the last stage only."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"`self.{self.name}` was called on stage {self.stage}, before the backbone call. Modules outside the"
            " backbone live on the last stage only, so code before the backbone call must hold no parameters (data"
            f" preparation only). Move `{self.name}` into the backbone as its first layer, or call it after the"
            " backbone."
        )


def find_backbone(module: nn.Module, name: Optional[str] = None) -> str:
    """Name of the attribute of ``module`` that holds the ``nn.Sequential`` backbone.

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


def resolve_balance(
    balance: Union[None, str, Sequence[int]],
    layers: nn.Sequential,
    num_stages: int,
    costs: Optional[Sequence["LayerCost"]] = None,
    memory_limit: Optional[int] = None,
) -> list[int]:
    """Check a user's ``balance`` against the backbone, or choose the split that evens out a cost.

    Args:
        balance: layers per stage; or ``"params"``, ``"time"`` or ``"memory"`` for the contiguous split
            whose costliest stage is cheapest by that measure (see :func:`~lightning_gpipe.balance.balance_by`);
            ``None`` means ``"params"``.
        layers: the backbone.
        num_stages: K, the number of stages (devices of one pipeline).
        costs: the profiled :class:`~lightning_gpipe.balance.LayerCost` of each layer; needed for
            ``"time"``, ``"memory"`` and ``memory_limit``. Without it ``"params"`` counts parameters.
        memory_limit: bytes one stage may hold (see :func:`~lightning_gpipe.balance.balance_by`), or ``None``.

    Raises:
        ValueError: if the lengths or the sum do not match, a stage is empty, there are fewer layers than
            stages, ``costs`` are missing or of another length, or no split fits ``memory_limit``.
    """
    # imported here: the balance package runs layers through Partition, so it imports this module
    from lightning_gpipe.balance import balance_by, solve

    count = len(layers)
    if balance is None or isinstance(balance, str):
        if count < num_stages:
            raise ValueError(
                f"The backbone has {count} layers, fewer than the {num_stages} stages (devices); use fewer devices"
                " or split the backbone into more layers."
            )
        mode = balance or "params"
        if costs is None and mode == "params" and memory_limit is None:
            return solve([sum(p.numel() for p in layer.parameters()) for layer in layers], num_stages)
        if costs is None or len(costs) != count:
            raise ValueError(
                f"balance={mode!r} needs the profiled cost of each of the {count} backbone layers, got"
                f" {'none' if costs is None else len(costs)}; measure them with `lightning_gpipe.profile_layers`."
            )
        return balance_by(mode, costs, num_stages, memory_limit)
    balance = list(balance)
    if len(balance) != num_stages:
        raise ValueError(
            f"balance={balance} has {len(balance)} stages but the pipeline has {num_stages} devices; give one"
            " layer count per device."
        )
    if any(size < 1 for size in balance):
        raise ValueError(f"balance={balance} leaves a stage empty; every stage needs at least one layer.")
    if sum(balance) != count:
        raise ValueError(f"balance={balance} sums to {sum(balance)} but the backbone has {count} layers.")
    return balance


class Split:
    """A LightningModule split for one stage, and how to undo it.

    Args:
        module: the LightningModule; changed in place.
        backbone: attribute name of its ``nn.Sequential`` backbone.
        balance: layers per stage (validated).
        stage: this process's pipeline rank.
    """

    def __init__(self, module: nn.Module, backbone: str, balance: Sequence[int], stage: int) -> None:
        self.module, self.backbone, self.stage = module, backbone, stage
        self.sequential: nn.Sequential = getattr(module, backbone)
        names = list(self.sequential._modules)
        start = sum(balance[:stage])
        local = names[start : start + balance[stage]]
        for name in names:
            if name not in local:
                self.sequential._modules[name].to("meta")
        self.partition = Partition({name: self.sequential._modules[name] for name in local})
        setattr(module, backbone, self.partition)
        self.freed: dict[str, nn.Module] = {}
        if stage < len(balance) - 1:
            self._free_modules_outside_backbone()

    def _free_modules_outside_backbone(self) -> None:
        for name, child in list(self.module.named_children()):
            if name != self.backbone and _holds_state(child):
                self.freed[name] = child.to("meta")
                setattr(self.module, name, _Freed(name, self.stage))

    def undo(self, full_state: Optional[dict[str, Tensor]] = None) -> None:
        """Put the original backbone and modules back in place.

        Args:
            full_state: the whole model's state dict (the union of all stages'); when given, the
                other stages' layers are materialised on the CPU and loaded from it, so the module is
                whole again. Without it they stay on the meta device.
        """
        setattr(self.module, self.backbone, self.sequential)
        for name, child in self.freed.items():
            setattr(self.module, name, child)
        if full_state is not None:
            for child in [*self.sequential, *self.freed.values()]:
                if any(t.is_meta for t in [*child.parameters(), *child.buffers()]):
                    child.to_empty(device=torch.device("cpu"))
            self.module.load_state_dict(full_state)


_RESETS = ("reset_parameters", "_reset_parameters")  # torch's names; nn.MultiheadAttention has the second


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta-device parameters and buffers on ``device`` and initialise them.

    Modules created on the meta device (in ``configure_model``, or under
    ``Trainer.init_module(empty_init=True)``) hold no memory; after the split each stage calls
    this on its own part, so no process ever holds the whole model. Every module whose
    tensors were on the meta device is initialised with its ``reset_parameters()`` (or
    ``_reset_parameters()``), children before parents as in construction, so a parent's
    reset (e.g. ``nn.MultiheadAttention``'s) has the last word.

    Raises:
        ValueError: if a meta tensor belongs to a module with no reset method, directly or
            through an ancestor (its values could not be initialised).
    """
    meta = [sub for sub in module.modules() if any(t.is_meta for t in _own_tensors(sub))]
    if not meta:
        return
    covered = _covered_by_reset(module)
    uncovered = [sub for sub in meta if sub not in covered]
    if uncovered:
        names = {sub: name for name, sub in module.named_modules()}
        raise ValueError(
            f"`{names[uncovered[0]] or type(module).__name__}` ({type(uncovered[0]).__name__}) was created on the"
            " meta device but has no `reset_parameters()` to initialise it on its stage. Give the module a"
            " `reset_parameters()` that fills its parameters and buffers, or create it outside `configure_model`."
        )
    resets = [sub for sub in module.modules() if any(t.is_meta for t in [*sub.parameters(), *sub.buffers()])]
    for sub in meta:
        sub.to_empty(device=device, recurse=False)
    for sub in reversed(resets):
        reset = next((getattr(sub, name) for name in _RESETS if hasattr(sub, name)), None)
        if reset is not None:
            with torch.no_grad():
                reset()


def _own_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _covered_by_reset(module: nn.Module) -> set[nn.Module]:
    """Modules that have a reset method or lie below one that has."""
    covered: set[nn.Module] = set()
    for sub in module.modules():
        if sub not in covered and any(hasattr(sub, name) for name in _RESETS):
            covered.update(sub.modules())
    return covered


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _is_activation(value: object) -> bool:
    if isinstance(value, Tensor):
        return True
    return isinstance(value, tuple) and len(value) > 0 and all(isinstance(x, Tensor) for x in value)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of ({', '.join(type(x).__name__ for x in value)})"
    return f"a {type(value).__name__}"
