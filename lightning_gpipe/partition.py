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
from typing import Optional, Union

import torch
from torch import Tensor, nn

from lightning_gpipe.balance import solve

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


def resolve_balance(balance: Optional[Sequence[int]], layers: nn.Sequential, num_stages: int) -> list[int]:
    """Check a user's ``balance`` against the backbone, or choose one that evens out parameter counts.

    Args:
        balance: layers per stage, or ``None`` for the split with the smallest largest stage by parameter count.
        layers: the backbone.
        num_stages: K, the number of stages (devices of one pipeline).

    Raises:
        ValueError: if the lengths or the sum do not match, a stage is empty, or there are fewer layers than stages.
    """
    count = len(layers)
    if balance is None:
        if count < num_stages:
            raise ValueError(
                f"The backbone has {count} layers, fewer than the {num_stages} stages (devices); use fewer devices"
                " or split the backbone into more layers."
            )
        return solve([sum(p.numel() for p in layer.parameters()) for layer in layers], num_stages)
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
