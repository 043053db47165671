"""Tensor parallelism inside each stage: the module's ``configure_model`` splits the layers the stage holds.

With ``tensor_parallel_size`` T > 1 each stage is T processes (:class:`~lightning_gpipe.engine.Topology`, tensor ranks
innermost), which hold its layers split as a user of Lightning's ``ModelParallelStrategy`` writes it: torch's
``parallelize_module`` over ``self.device_mesh["tensor_parallel"]`` in ``configure_model`` (Megatron-LM's
column- then row-parallel layers, Shoeybi et al. 2019, section 3; torch's DTensor). Lightning calls that hook before
the split, on the whole module; the strategy calls it again on each stage right after the split, before the
data-parallel wrapping (torchtitan's order: tensor, then data parallelism), and skips Lightning's call where the module
already holds its backbone (:func:`~lightning_gpipe.lightning._lightning.configure_model_after_split`; Lightning asks
the hook to be idempotent). A module that creates its layers in ``configure_model`` (the Hugging Face modules) creates
them in the first call and splits them in the second. The backbone attribute
is then the stage's partition, its layers under their original names, so a plan over ``self.backbone``
(``{"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}``) splits the layers this stage holds, and keys that name
another stage's layers are skipped (torch warns that they "could not be resolved").

The planner (``plan="auto"``, :func:`~lightning_gpipe.lightning.planner.plan`) counts one tensor rank's memory from how
the split leaves each layer (:func:`layer_splits`), which it must know before the split: from the module's own
declaration (``tensor_targets``, the Hugging Face modules': transformers' tensor plan) or a plan given to ``plan()``.

What crosses a stage boundary is what the stage's last layer returns, sent from each tensor rank to the same tensor
rank of the next stage: a plain tensor, the same on every tensor rank after a row-parallel layer
(``use_local_output=True``, torch's default: all-reduced), or each rank's own part of it (a sequence-parallel layer's
local shard), which the next stage's first layer must then expect. A ``DTensor`` does not cross: give the last
layer's style ``use_local_output=True``.
"""

from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe._torch import forward_hooks, remove_forward_hooks
from lightning_gpipe.planning import LayerSplit, layer_split, matching_modules

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl


class TensorSplit:
    """The split of this stage's layers over its tensor ranks, made by the module's deferred ``configure_model`` right
    after the pipeline's split (see the module docstring), and undone after a completed run.

    Args:
        module: the LightningModule, split into this stage.
        configure_model: makes the call Lightning deferred (``None``: the module does not override the hook).
        stage: how messages name this process (``"stage 1, tensor rank 0 of replica 0 (rank 2)"``).

    Raises:
        ValueError: if ``configure_model`` split a layer this stage does not hold (one on the meta device: another
            stage's), naming it and the fix.

    Where it split nothing, global rank 0 warns: each tensor rank then holds the whole stage, correct but no smaller.
    """

    def __init__(self, module: "pl.LightningModule", configure_model: "Callable[[], None] | None", stage: str) -> None:
        self.module = module
        _check_unsplit(module)
        before = forward_hooks(module)
        if configure_model is not None:
            configure_model()
        self.hooks = forward_hooks(module) - before  # the layers' input and output conversions
        _check_held(module, stage)

    def undo(self) -> None:
        """Give every split parameter its whole value again as a plain parameter (one all-gather each: a collective
        call of the stage's tensor ranks) and remove the conversions ``parallelize_module`` hooked on, so the module
        leaves the run plain."""
        whole: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for module in self.module.modules():
                for name, parameter in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                    if _split(parameter):
                        if id(parameter) not in whole:
                            value = parameter.full_tensor()  # type: ignore[attr-defined]  # a DTensor
                            whole[id(parameter)] = nn.Parameter(value, requires_grad=parameter.requires_grad)
                        module.register_parameter(name, whole[id(parameter)])
        remove_forward_hooks(self.module, self.hooks)


def _check_unsplit(module: "pl.LightningModule") -> None:
    """Raise a ``ValueError`` naming the fix where ``configure_model`` split layers before the pipeline's split."""
    split = [name for name, p in module.named_parameters(remove_duplicate=False) if _split(p)]
    if split:
        raise ValueError(
            f"configure_model split {', '.join(split[:3])}{' ...' if len(split) > 3 else ''} over the tensor ranks"
            " before the pipeline split its backbone: with tensor_parallel_size > 1 configure_model runs again after"
            " the split, on the layers each stage holds. Create the model first (in __init__, or in a configure_model"
            " that returns once it exists) and split it when configure_model finds it created."
        )


def _check_held(module: "pl.LightningModule", stage: str) -> None:
    """Raise the ``ValueError`` of :class:`TensorSplit` for split parameters of layers the stage does not hold; warn
    (global rank 0) where nothing is split."""
    elsewhere = [name for name, p in module.named_parameters(remove_duplicate=False) if _split(p) and p.is_meta]
    if elsewhere:
        raise ValueError(
            f"configure_model split {', '.join(elsewhere[:3])}{' ...' if len(elsewhere) > 3 else ''} over the tensor"
            f" ranks on {stage}, which does not hold it: with tensor_parallel_size > 1 configure_model runs on every"
            " stage after the split, where the layers of other stages are on the meta device. Split the layers of the"
            " backbone attribute (on each stage, the layers it holds under their original names), e.g."
            ' parallelize_module(self.backbone, self.device_mesh["tensor_parallel"], {"*.0": ColwiseParallel()}).'
        )
    if not any(_split(p) for p in module.parameters()):
        rank_zero_warn(
            f"tensor_parallel_size > 1, but configure_model split no parameter of {stage}: each of its tensor ranks"
            " holds the whole stage. Split its layers with parallelize_module over"
            ' self.device_mesh["tensor_parallel"] (docs/scaling.md, "3D parallelism").',
            category=PossibleUserWarning,
        )


def _split(parameter: nn.Parameter) -> bool:
    return isinstance(parameter, DTensor)


def layer_splits(
    module: "pl.LightningModule", backbone: str, size: int, tensor_plan: dict[str, Any] | None = None
) -> list[LayerSplit]:
    """How the split over ``size`` tensor ranks will leave each layer of ``module``'s backbone, for the planner
    (:func:`~lightning_gpipe.planning.layer_split`; one per layer, empty for ``size`` 1): from ``tensor_plan``, a plan
    as ``parallelize_module`` takes it over the backbone (``{"*.0": ColwiseParallel(), "*.2": RowwiseParallel()}``, keys
    whose first part names backbone layers), else from the module's ``tensor_targets(size)`` (the Hugging Face
    modules: transformers' declared plan), which gives each layer's split modules and their styles.

    Raises:
        ValueError: for a module that declares no split and no ``tensor_plan`` (``configure_model``'s split exists only
            once it runs, on a tensor mesh of ``size`` processes), naming the fix; a style the planner does not take.
    """
    if size == 1:
        return []
    layers = list(getattr(module, backbone).named_children())
    declared = getattr(module, "tensor_targets", None)
    targets: list[list[tuple[nn.Module, Any]]]
    if tensor_plan is not None:
        targets = [
            [(target, style) for key, style in tensor_plan.items() for _, target in _keyed(name, layer, key)]
            for name, layer in layers
        ]
    elif callable(declared):
        targets = declared(size)
    else:
        raise ValueError(
            f"The planner cannot tell how {type(module).__name__}.configure_model splits the backbone's layers over"
            f" tensor_parallel_size={size} ranks: the split exists only once it runs on {size} processes. Plan with"
            f" lightning_gpipe.plan(module, world_size, memory_limit, tensor_parallel_size={size}, tensor_plan=PLAN),"
            " PLAN the dict configure_model gives parallelize_module over the backbone (e.g. {'*.0': ColwiseParallel(),"
            " '*.2': RowwiseParallel()}), and give GPipeStrategy the plan's options (report.chosen.plan.options())"
            " instead of plan='auto'."
        )
    return [layer_split(_in_module_order(layer, each)) for (_, layer), each in zip(layers, targets)]


def _in_module_order(layer: nn.Module, targets: list[tuple[nn.Module, Any]]) -> list[tuple[nn.Module, Any]]:
    """``targets`` (modules of ``layer`` with their styles) in the order of ``layer.modules()``: its last split module
    decides how its output is laid out."""
    order = {id(each): j for j, each in enumerate(layer.modules())}
    return sorted(targets, key=lambda target: order.get(id(target[0]), len(order)))


def _keyed(name: str, layer: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The modules of backbone layer ``name`` (``layer``) that a ``parallelize_module`` plan's ``key`` over the
    backbone names, in module order."""
    first, *rest = key.split(".")
    return list(matching_modules(layer, rest)) if fnmatch(name, first) else []
