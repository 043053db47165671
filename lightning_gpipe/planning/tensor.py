"""Tensor parallelism in the planner: what each backbone layer costs one of its stage's T tensor ranks.

A stage split over T tensor ranks (Megatron-LM's column- and row-parallel layers, Shoeybi et al. 2019, section 3)
holds on each rank ``1/T`` of every parameter the split divides, with its gradient and optimizer state, and the whole
of every other one. Its activations are as the split leaves them: a column-parallel layer's output is ``1/T`` (each
rank its columns), a row-parallel layer's whole (all-reduced), and a layer the split does not touch passes its input's
layout on (the ReLU between the two). What a layer's profile measured on one process (its
:class:`~lightning_gpipe.planning.balance.LayerCost`) becomes one rank's by :func:`per_tensor_rank`, from how the split
leaves each layer (:class:`LayerSplit`, made by :func:`layer_split` from the modules the split applies to and their
styles, transformers' names or torch's :class:`~torch.distributed.tensor.parallel.ParallelStyle` objects):

- parameters: the divided bytes over T (torch's shards where T divides the split dimensions), the rest whole;
- the layer's saved input and output, and its output: over T where divided, else whole; what else it saves (the
  tensors inside it), its transient and the gradients B keeps for W: scaled by ``1 - s + s / T``, ``s`` the divided
  share of its parameters (a decoder layer's attention and MLP tensors are divided with their projections; its norms'
  are not);
- times: the compute scaled alike, plus one all-reduce over the T ranks (:meth:`~lightning_gpipe.planning.costs.
  CostModel.all_reduce_time`) of the whole output per row-parallel (or gathered column-parallel) module in the
  forward, and of the whole input's gradient per column-parallel module in the backward (its B half under a split).

So the parameters are exact; the activations inside a layer are an estimate (an upper bound of none of them divided
and a lower bound of all are the layer's measured bytes and its bytes over T). A sequence-parallel or input- or
output-preparing style divides no parameter and is counted whole.
"""

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.costs import CostModel, ProfiledCosts

COLUMN, GATHERED, ROW = "column", "gathered", "row"
"""How a style splits a module: by output columns (its output divided), the same with the output gathered whole, or
by input rows (its output all-reduced, whole)."""

KINDS = {
    "colwise": COLUMN,
    "colwise_gather_output": GATHERED,
    "colwise_rep": GATHERED,
    "rowwise": ROW,
    "rowwise_split_input": ROW,
    "embedding_rowwise": ROW,
}
"""transformers' style names (a config's ``base_model_tp_plan``) by how they split."""

UNDIVIDED = (SequenceParallel, PrepareModuleInput, PrepareModuleOutput)
"""torch's styles that divide no parameter (counted whole)."""


@dataclass(frozen=True)
class LayerSplit:
    """How the tensor split leaves one backbone layer on each of its stage's tensor ranks.

    Args:
        divided_bytes: of the layer's parameter bytes, those the split divides over the ranks (default 0).
        output_divided: whether each rank holds ``1/T`` of the layer's output; ``None`` (default): as its input (a
            layer the split does not touch).
        forward_collectives: collectives of the whole output in the layer's forward (its row-parallel and gathered
            column-parallel modules).
        backward_collectives: all-reduces of the whole input's gradient in its backward (its column-parallel
            modules, whose replicated input's gradient each rank computes in part).
    """

    divided_bytes: int = 0
    output_divided: bool | None = None
    forward_collectives: int = 0
    backward_collectives: int = 0


def style_kind(style: Any) -> str | None:
    """How ``style`` splits a module: :data:`COLUMN`, :data:`GATHERED` or :data:`ROW`, or ``None`` for a style that
    divides no parameter (:data:`UNDIVIDED`).

    Args:
        style: a transformers style name (:data:`KINDS`) or a torch ``ParallelStyle``.

    Raises:
        ValueError: for any other style, naming it.
    """
    if isinstance(style, str) and style in KINDS:
        return KINDS[style]
    if isinstance(style, ColwiseParallel):
        return GATHERED if isinstance(style.output_layouts[0], Replicate) else COLUMN
    if isinstance(style, RowwiseParallel):
        return ROW
    if isinstance(style, UNDIVIDED):
        return None
    raise ValueError(
        f"The planner does not know how the tensor style {style!r} divides a module: it counts ColwiseParallel,"
        f" RowwiseParallel and transformers' {', '.join(KINDS)} (and SequenceParallel, PrepareModuleInput or"
        " PrepareModuleOutput as dividing nothing)."
    )


def layer_split(targets: Sequence[tuple[nn.Module, Any]]) -> LayerSplit:
    """How a layer is split, from the modules of it the split applies to, in module order, each with its style
    (:func:`style_kind`): a column-parallel module divides all its parameters but a LoRA adapter's ``lora_A`` (kept
    whole), a row-parallel one all but its bias and ``lora_B``; the layer's output is divided where its last split
    module is column-parallel (not gathered).

    Raises:
        ValueError: for a style :func:`style_kind` does not take.
    """
    divided, output, forward, backward = 0, None, 0, 0
    for target, style in targets:
        kind = style_kind(style)
        if kind is None:
            continue
        whole = "lora_B" if kind == ROW else "lora_A"
        for name, parameter in target.named_parameters():
            parts = name.split(".")
            if whole not in parts and not (kind == ROW and parts[-1] == "bias"):
                divided += parameter.numel() * parameter.element_size()
        output = kind == COLUMN
        forward += kind != COLUMN
        backward += kind != ROW
    return LayerSplit(divided, output, forward, backward)


def matching_modules(module: nn.Module, tokens: Sequence[str], prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """The submodules of ``module`` that the dotted path ``tokens`` names, with their paths below it, as torch's
    ``parallelize_module`` resolves a plan's keys: each token matches a child's name, wildcards allowed
    (:func:`fnmatch.fnmatch`)."""
    if not tokens:
        yield prefix, module
        return
    for name, child in module.named_children():
        if fnmatch(name, tokens[0]):
            yield from matching_modules(child, tokens[1:], f"{prefix}.{name}" if prefix else name)


def per_tensor_rank(
    profiled: ProfiledCosts, splits: Sequence[LayerSplit], size: int, model: CostModel = CostModel()
) -> ProfiledCosts:
    """``profiled`` (the whole backbone's layers, measured on one process) as one of ``size`` tensor ranks runs and
    holds them (see the module docstring); ``profiled`` itself for one rank.

    Args:
        profiled: the layers' costs at two micro-batch sizes.
        splits: one :class:`LayerSplit` per layer.
        size: T, the tensor ranks of each stage.
        model: the machine's constants (the all-reduces' bandwidth).

    Raises:
        ValueError: if ``splits`` does not have one entry per layer.
    """
    if size == 1:
        return profiled
    if len(splits) != len(profiled.large):
        raise ValueError(f"per_tensor_rank needs one LayerSplit per layer: {len(splits)} for {len(profiled.large)}.")
    divided, layouts = False, []
    for split in splits:  # the first layer's input is the batch, whole on every rank
        output = divided if split.output_divided is None else split.output_divided
        layouts.append((divided, output))
        divided = output

    def ranked(costs: Sequence[LayerCost], rows: int) -> list[LayerCost]:
        inputs = [round(profiled.input_bytes * rows / profiled.batch_rows), *(c.output_bytes for c in costs)]
        return [
            _on_rank(cost, split, size, model, layout, whole_input)
            for cost, split, layout, whole_input in zip(costs, splits, layouts, inputs)
        ]

    return replace(
        profiled, large=ranked(profiled.large, profiled.rows[0]), small=ranked(profiled.small, profiled.rows[1])
    )


def _on_rank(
    cost: LayerCost, split: LayerSplit, size: int, model: CostModel, layout: tuple[bool, bool], whole_input: int
) -> LayerCost:
    """One layer's ``cost`` on one of ``size`` ranks (``layout``: whether its input and its output are divided;
    ``whole_input``: its input's bytes, whole)."""
    share = split.divided_bytes / cost.parameter_bytes if cost.parameter_bytes else 0.0
    scale = 1 - share + share / size

    def part(nbytes: int, divided: bool) -> int:
        return math.ceil(nbytes / size) if divided else nbytes

    input_saved, output_saved = part(cost.input_saved_bytes, layout[0]), part(cost.output_saved_bytes, layout[1])
    inside = max(cost.activation_bytes - cost.input_saved_bytes - cost.output_saved_bytes, 0)
    spared = (cost.input_saved_bytes - input_saved) + (cost.output_saved_bytes - output_saved) + inside
    forward = split.forward_collectives * model.all_reduce_time(cost.output_bytes, size)
    backward = split.backward_collectives * model.all_reduce_time(whole_input, size)
    return replace(
        cost,
        forward=cost.forward * scale + forward,
        backward=cost.backward * scale + backward,
        input_grad=cost.input_grad * scale + (backward if cost.input_grad else 0.0),
        weight_grad=cost.weight_grad * scale,
        activation_bytes=max(cost.activation_bytes - spared + round(inside * scale), 0),
        output_bytes=part(cost.output_bytes, layout[1]),
        parameter_bytes=cost.parameter_bytes - split.divided_bytes + math.ceil(split.divided_bytes / size),
        input_saved_bytes=input_saved,
        output_saved_bytes=output_saved,
        transient_bytes=round(cost.transient_bytes * scale),
        kept_grad_bytes=round(cost.kept_grad_bytes * scale),
    )
