"""Hugging Face models split over each stage's tensor ranks as transformers declares them.

transformers declares how a model's layers split over tensor-parallel ranks: the config's ``base_model_tp_plan``
(paths below the base model, ``"layers.*.self_attn.q_proj": "colwise"``) and the class's ``_tp_plan`` (paths below
the whole model, ``"lm_head": "colwise_gather_output"``), in the styles of Megatron-LM's column- and row-parallel
layers (Shoeybi et al. 2019, section 3). With ``GPipeStrategy(tensor_parallel_size=T)`` the modules' ``configure_model``
runs again after the pipeline's split (:mod:`lightning_gpipe.lightning.tensor_parallel`), and :func:`split_stage`
applies the plan to the layers the stage holds with torch's ``parallelize_module``, each style as torch's
:class:`~torch.distributed.tensor.parallel.ColwiseParallel` or :class:`~torch.distributed.tensor.parallel.
RowwiseParallel` (:data:`STYLES`). Attention then runs on each rank's own heads (the projections' local outputs), the
row-parallel output projections all-reduce, and what crosses a stage boundary is whole on every tensor rank. The
planner reads the same modules and styles before the split (:func:`stage_targets`, the modules' ``tensor_targets``).

LoRA (``peft``): a column-parallel layer's adapter keeps ``lora_A`` whole and splits ``lora_B`` in the base layer's
style, a row-parallel one splits ``lora_A`` in its style and keeps ``lora_B`` whole, so the adapter's output is laid
out as the base layer's. A parameter tied to another (the head tied to the embeddings) stays whole. A model without a
plan, a style this module does not take (packed, expert-parallel, sequence-parallel, local styles) on a held layer, or
heads that the tensor ranks do not divide, is refused before step 1, naming it.
"""

from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_gpipe.hf.layer import HFLayer, UnsupportedModelError
from lightning_gpipe.planning import matching_modules

if TYPE_CHECKING:
    from transformers import PreTrainedModel

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""The transformers styles taken, as torch's: column-parallel (a replicated input, each rank's columns of the output;
``_gather_output``/``_rep``: all-gathered), row-parallel (each rank's rows: its part of the input, the output
all-reduced; ``_split_input``: a replicated input, split first), and the vocabulary-parallel embedding."""

KEPT_WHOLE = frozenset({"replicated_with_grad_allreduce", "replicate"})
"""Styles that leave a parameter whole on every tensor rank (its gradient is then the same on each)."""

TENSOR_PARALLEL = "tensor_parallel"
"""The name of the mesh dimension of the tensor ranks (Lightning's ``ModelParallelStrategy``'s)."""


def declared_plan(model: "PreTrainedModel") -> dict[str, str]:
    """The model's declared tensor plan, keys as paths below ``model``: the config's ``base_model_tp_plan`` under the
    base model's prefix, then the class's ``_tp_plan``."""
    prefix = model.base_model_prefix
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    plan = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def split_stage(module: Any) -> None:
    """Split the layers this stage of ``module`` (a :class:`~lightning_gpipe.hf.module.HFModule`, after the pipeline's
    split) holds over its ``device_mesh["tensor_parallel"]``, as its model declares (see the module docstring). Does
    nothing without tensor ranks, or once split.

    Raises:
        UnsupportedModelError: for a model without a tensor plan, a style not in :data:`STYLES` or
            :data:`KEPT_WHOLE` on a layer the stage holds, or heads the tensor ranks do not divide.
    """
    mesh = module.device_mesh
    if mesh is None or TENSOR_PARALLEL not in (mesh.mesh_dim_names or ()):
        return
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return
    ranks = mesh[TENSOR_PARALLEL]
    for targets in stage_targets(module, ranks.size()):
        for target, style in targets:
            _parallelize(target, ranks, style)


def stage_targets(module: Any, size: int) -> list[list[tuple[nn.Module, str]]]:
    """For each layer of ``module``'s backbone (a :class:`~lightning_gpipe.hf.module.HFModule`'s, whole or one
    stage's), the modules the model's declared plan splits over ``size`` tensor ranks, each with its style (one of
    :data:`STYLES`); none of a layer that is not the model's, or of one holding a tied parameter.

    Raises:
        UnsupportedModelError: as :func:`split_stage`.
    """
    model = module.hf_model
    plan = declared_plan(model)
    _check_splittable(model, size)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return [
        [pair for path in layer.paths for pair in _targets(layer.part(path), path, plan, tied)]
        if isinstance(layer, HFLayer)
        else []
        for layer in module.backbone.children()
    ]


def _check_splittable(model: "PreTrainedModel", size: int) -> None:
    name = type(model).__name__
    if not getattr(model.config, "base_model_tp_plan", None):  # the class's own plan covers its head at most
        raise UnsupportedModelError(
            f"{name} declares no tensor plan (its config's base_model_tp_plan is empty), so its layers cannot be split"
            f" over tensor_parallel_size={size} ranks as transformers splits them. Use tensor_parallel_size=1, or"
            " split the layers yourself in configure_model."
        )
    config = model.config
    for heads in ("num_attention_heads", "num_key_value_heads"):
        count = getattr(config, heads, None)
        if isinstance(count, int) and count % size:
            raise UnsupportedModelError(
                f"{name} has {heads}={count}, which tensor_parallel_size={size} does not divide: each tensor rank"
                " computes whole heads. Choose a tensor_parallel_size that divides the heads."
            )


def _targets(part: nn.Module, path: str, plan: dict[str, str], tied: set[str]) -> Iterator[tuple[nn.Module, str]]:
    """The modules of ``part`` (the module at ``path``) that an entry of ``plan`` at or below ``path`` splits, with
    its style."""
    for key, style in plan.items():
        below = _below(key.split("."), path.split("."))
        if below is None or style in KEPT_WHOLE:
            continue
        if style not in STYLES:
            raise UnsupportedModelError(
                f"{key} is declared '{style}' in the model's tensor plan, a style GPipeStrategy does not split with"
                f" yet (it takes {', '.join(sorted(STYLES))}). Use tensor_parallel_size=1 for this model."
            )
        for name, target in matching_modules(part, below):
            full = ".".join(filter(None, [path, name]))
            if not any(f"{full}.{p}" in tied for p, _ in target.named_parameters()):
                yield target, style


def _below(key: list[str], path: list[str]) -> list[str] | None:
    """What of the plan's ``key`` lies below ``path`` (both as tokens, ``key``'s maybe wildcards), or ``None`` where
    ``key`` does not reach into ``path``."""
    if len(key) < len(path) or not all(fnmatch(p, k) for p, k in zip(path, key, strict=False)):
        return None
    return key[len(path) :]


def _parallelize(target: nn.Module, ranks: DeviceMesh, style: str) -> None:
    """``style`` on ``target``; on a LoRA layer (``peft``), on its base layer and, laid out alike, its adapters."""
    base = getattr(target, "base_layer", None)
    if base is None:
        parallelize_module(target, ranks, STYLES[style]())
        return
    parallelize_module(base, ranks, STYLES[style]())
    column = isinstance(STYLES[style](), ColwiseParallel)  # the adapter's B splits its output, else A its input
    adapters: Any = target.lora_B if column else target.lora_A  # peft's ModuleDict of adapters, by name
    for adapter in adapters.values():
        parallelize_module(adapter, ranks, STYLES[style]())
