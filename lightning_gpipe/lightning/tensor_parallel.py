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

What crosses a stage boundary is what the stage's last layer returns, sent from each tensor rank to the same tensor
rank of the next stage: a plain tensor, the same on every tensor rank after a row-parallel layer
(``use_local_output=True``, torch's default: all-reduced), or each rank's own part of it (a sequence-parallel layer's
local shard), which the next stage's first layer must then expect. A ``DTensor`` does not cross: give the last
layer's style ``use_local_output=True``.
"""

from typing import TYPE_CHECKING

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_gpipe._torch import forward_hooks, remove_forward_hooks

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
