"""Tied parameters: one ``nn.Parameter`` used by modules on several stages.

A language model's input embedding and output projection often share one weight (Press & Wolf 2017), and a
backbone may use one layer at two positions. When the split puts those users on different stages, every
stage that uses the parameter holds a copy of it. The copies start equal (:meth:`TiedParameters.synchronize`
sends the first holder's values to the others, as modules created on the meta device are initialised on each
stage), their gradients are summed over the holding stages before the optimizer step
(:meth:`TiedParameters.reduce_grads`), so every copy gets the gradient of the whole model and steps alike.
One process group per tie and pipeline (the data-parallel replica without tensor parallelism), made with
``dist.new_group`` on every rank: the same approach as Megatron-LM's embedding group (Shoeybi et al. 2019, and
``megatron/core/parallel_state.py``).

Ties are found from the module itself (:func:`find_ties`): a parameter reachable under several state-dict
names whose owners fall on different stages. Each stage keeps its copy under its own names, so a checkpoint
has one entry per name, as the module without the strategy, and loads into it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_gpipe._torch import children
from lightning_gpipe.engine.actions import stage_of_virtual
from lightning_gpipe.engine.partition import backbone_aliases
from lightning_gpipe.engine.topology import Topology
from lightning_gpipe.faults import waiting

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job


@dataclass(frozen=True)
class Tie:
    """One parameter used on several stages.

    Attributes:
        names: its state-dict names in the whole module, in module order.
        stages: the stages holding one of those names, ascending (at least two).
        stage_of_name: the stage of each name, in the order of ``names``.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    stage_of_name: tuple[int, ...]

    def local_name(self, stage: int) -> str:
        """A name of the tie held on ``stage`` (the first)."""
        return self.names[self.stage_of_name.index(stage)]


def find_ties(
    module: nn.Module,
    backbone: str,
    balance: Sequence[int],
    num_stages: int | None = None,
    v_shape: bool = False,
) -> list[Tie]:
    """The parameters of ``module`` used on more than one stage when its backbone is split by ``balance``.

    A name under the backbone belongs to the stage of its layer, as does a name under another attribute that leads
    to the backbone or one of its layers (``model.blocks.3.weight`` of a module that keeps the whole model, see
    :func:`~lightning_gpipe.engine.partition.backbone_aliases`); any other name to the stage of the last virtual
    stage (heads live there). Call it before the split, while the module is whole.

    Args:
        module: the LightningModule.
        backbone: the attribute name of its ``nn.Sequential`` backbone.
        balance: layers per (virtual) stage.
        num_stages: K, the stages (processes); ``None`` (default): ``len(balance)``. With virtual stages,
            virtual stage s is on stage ``s % K``, and a parameter two model chunks of one stage use is one object
            there, not a tie.
        v_shape: whether the virtual stages are placed in a V
            (:func:`~lightning_gpipe.engine.actions.stage_of_virtual`).

    Returns:
        The ties, in module order (the same on every process).
    """
    num_stages = len(balance) if num_stages is None else num_stages
    layers = list(children(getattr(module, backbone)))
    stages: Sequence[int] = [stage_of_virtual(s, num_stages, v_shape)[0] for s in range(len(balance))]
    stage_of_layer = dict(zip(layers, (stages[s] for s, n in enumerate(balance) for _ in range(n))))
    last = stages[-1]
    aliases = {backbone: None, **backbone_aliases(module, backbone)}

    def stage_of(name: str) -> int:
        for path, layer in aliases.items():
            if name.startswith(path + "."):
                return stage_of_layer[layer if layer is not None else name[len(path) + 1 :].split(".")[0]]
        return last

    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    ties = []
    for group in names.values():
        stages = tuple(stage_of(name) for name in group)
        if len(set(stages)) > 1:
            ties.append(Tie(tuple(group), tuple(sorted(set(stages))), stages))
    return ties


class TiedParameters:
    """This stage's part in the model's ties: a process group per tie it holds, to sync values and sum gradients.

    Makes every tie's group on every rank (``dist.new_group`` is collective over the whole job), for every
    pipeline (the data-parallel replica without tensor parallelism): the group of a tie is the ranks of its holding
    stages within one pipeline.

    Args:
        ties: every tie of the model (:func:`find_ties`), the same list on every rank.
        module: this stage's LightningModule, after the split.
        topology: the job's mesh.
        rank: this process's global rank.
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the collectives use.

    Attributes:
        held: whether this stage holds a copy of any tie (else a step needs nothing of it).
    """

    def __init__(self, ties: list[Tie], module: nn.Module, topology: Topology, rank: int, job: "Job") -> None:
        self.module, self.stage, self.rank, self.job = module, topology.stage_of(rank), rank, job
        self._held: list[tuple[Tie, dist.ProcessGroup | None, list[int]]] = []
        self.held = False
        pipeline = topology.pipeline_of(rank)
        for p in range(topology.num_pipelines):
            for tie in ties:
                ranks = [topology.rank_of(stage, p) for stage in tie.stages]
                group = dist.new_group(ranks) if dist.is_initialized() else None
                if p == pipeline and rank in ranks:
                    self._held.append((tie, group, ranks))
        self.held = bool(self._held)

    @property
    def process_groups(self) -> list[dist.ProcessGroup]:
        """The process groups of the ties this stage holds (none without a process group of the job)."""
        return [group for _, group, _ in self._held if group is not None]

    def _parameter(self, tie: Tie) -> nn.Parameter:
        return self.module.get_parameter(tie.local_name(self.stage))

    def synchronize(self) -> None:
        """Give every copy of each tie the values of its first holding stage's copy (a collective call), once the
        holders found their copies laid out alike (:func:`check_layouts`).

        Raises:
            ValueError: on every holder of a tie whose copies are laid out differently, naming the fix.
            PipelineFailure: if another stage failed or stalled meanwhile.
        """
        for tie, group, ranks in self._held:
            own = layout(self._parameter(tie))
            if group is not None:
                held = [waiting.broadcast_object(self.job, own, src, group) for src in ranks]
                check_layouts(tie, held)
            with torch.no_grad():
                waiting.broadcast(self.job, _local(self._parameter(tie).data), ranks[0], group)

    def reduce_grads(self) -> None:
        """Sum each tie's gradients over its holding stages, in place. A copy without a gradient counts as zeros
        and gets the sum; when no copy has one, all keep none (as the one parameter on one device). One
        all-reduce per tie, of the gradient and a has-gradient count together; a copy that had a gradient knows the
        sum has one without reading the count (no device-to-host copy in the usual step). Call once per optimizer step,
        after the last backward of the step (a collective call). A frozen tie (``requires_grad=False``, alike on every
        copy: one parameter of the user's model) has no gradient to sum and is skipped. Copies sharded over the
        data-parallel replicas (FSDP2's ``DTensor``) sum their local shards: each replica's copies hold the same rows;
        copies split by tensor parallelism alike (:func:`check_layouts`) sum their local parts, each gradient first laid
        out as its parameter (a split embedding's comes back whole).

        Raises:
            PipelineFailure: if another stage failed or stalled meanwhile.
        """
        for tie, group, _ in self._held:
            parameter = self._parameter(tie)
            if not parameter.requires_grad:
                continue
            has = parameter.grad is not None
            if has:
                parameter.grad = _laid_out_as(parameter, cast(Tensor, parameter.grad))
            grad = _local(cast(Tensor, parameter.grad) if has else torch.zeros_like(parameter))
            flat = torch.cat([grad.flatten(), grad.new_full((1,), float(has))])
            waiting.all_reduce(self.job, flat, group=group)
            if has or flat[-1].item() > 0:  # the count is read on the host only where this copy had no gradient
                if not has:
                    parameter.grad = torch.empty_like(parameter)
                assert parameter.grad is not None  # it had one, or got one just now
                _local(parameter.grad).copy_(flat[:-1].view_as(grad))

    def after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (Lightning's step closure: the step's forward and backward), then :meth:`reduce_grads`, so that
        the optimizer steps every copy of a tie with the summed gradient."""

        def closure_and_ties() -> Any:
            result = closure()
            self.reduce_grads()
            return result

        return closure_and_ties

    def uncounted(self) -> list[Tensor]:
        """This stage's copies that the global gradient norm must not count: every tie's copies but those of its
        first holding stage, so a tied parameter is counted once."""
        return [self._parameter(tie) for tie, _, _ in self._held if tie.stages[0] != self.stage]


def _local(tensor: Tensor) -> Tensor:
    """``tensor``'s local values: a ``DTensor``'s shard on this process (FSDP2 shards a tie's copies alike on every
    stage: same shape, same data-parallel replicas), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _laid_out_as(parameter: Tensor, grad: Tensor) -> Tensor:
    """``grad`` laid out over the tensor ranks as ``parameter`` is, so that every holder of a tie sums local parts of
    one shape: a split embedding's gradient comes back whole (``Replicate``, each rank computed all of it) where its
    weight is split by rows (``Shard(0)``); taking this rank's rows of it moves nothing."""
    if isinstance(parameter, DTensor) and isinstance(grad, DTensor) and grad.placements != parameter.placements:
        return grad.redistribute(parameter.device_mesh, parameter.placements)
    return grad


def layout(parameter: Tensor) -> str:
    """How ``parameter`` is laid out over its process's tensor ranks: ``"whole"``, or a ``DTensor``'s placements and
    ranks (``"split as (Shard(dim=0),) over 2 ranks"``)."""
    if not isinstance(parameter, DTensor):
        return "whole"
    return f"split as {tuple(parameter.placements)} over {parameter.device_mesh.size()} ranks"


def check_layouts(tie: Tie, layouts: Sequence[str]) -> None:
    """Raise a ``ValueError`` naming the fix where the copies of ``tie`` are laid out differently (``layouts``: each
    holding stage's :func:`layout`, in the order of ``tie.stages``): a tensor plan that splits a tied parameter on one
    of its stages and not on another (a head split by output columns, the embedding tied to it whole) leaves copies
    that cannot start equal nor sum their gradients."""
    if len(set(layouts)) <= 1:
        return
    held = "; ".join(f"stage {stage}: {each}" for stage, each in zip(tie.stages, layouts))
    raise ValueError(
        f"The parameter {' = '.join(tie.names)}, tied across stages {', '.join(map(str, tie.stages))}, is laid out"
        f" differently on them over the tensor ranks ({held}), so its copies cannot start equal nor sum their"
        " gradients. Split it alike on every stage that holds it (a Linear head split by output columns,"
        " ColwiseParallel, and the Embedding tied to it split by rows, RowwiseParallel, both shard the weight's first"
        " dimension), or on none: leave its modules out of the tensor plan of every stage."
    )
