"""A stage's replicas: their gradients averaged once per optimizer step by torch's DDP, or the stage's state sharded
over them by torch's FSDP2.

**Averaged by DDP** (``sharding_strategy="NO_SHARD"``, the default). Each stage's replicas (the same stage of every
pipeline, its ``"data_parallel"`` process group) hold the same parameters and compute gradients on different shards of
the data.
:class:`GradientSync` wraps what this stage trains in :class:`torch.nn.parallel.DistributedDataParallel` and lets DDP's
reducer average the gradients: bucketed, and overlapped with the step's last backward. The micro-batches' gradients
accumulate locally first; only the step's last autograd call on this stage, the one that completes its gradients, is
announced to the reducer (``reducer.prepare_for_backward``, as torch.distributed.pipelining's stages do with DDP), so
the reducer all-reduces each bucket once, as soon as that call has produced it. Parameters whose gradients were complete
before that call (a head on the last stage, layers an earlier micro-batch used) are found by DDP's
``find_unused_parameters`` search and reduced with the first bucket; parameters no replica gave a gradient keep
``None``, as under DDP. Within a gradient-accumulation window nothing is announced, so the window's summed gradients are
reduced once, at its end. Forwards do not go through DDP: the engine runs the stage's layers itself (micro-batches,
recomputes), so DDP's per-forward buffer broadcast is off; the replicas start from rank 0's parameters and buffers,
which DDP broadcasts when it is built.

**Sharded by FSDP2** (``sharding_strategy="SHARD_GRAD_OP" | "FULL_SHARD"``, with several replicas): the replicas of a
stage no longer each hold its whole state. :class:`FullyShardedStage` applies torch's FSDP2
(:func:`torch.distributed.fsdp.fully_shard`) over the ``"data_parallel"`` dimension, as torchtitan composes its
pipeline with FSDP (``fully_shard`` on each stage's model chunk over the data-parallel mesh;
torch.distributed.pipelining's ``_PipelineStageBase.backward_maybe_with_nosync`` and ``perform_reduce_grad`` drive
FSDP2 the same way). Each parameter becomes a ``DTensor`` sharded on dim 0 (with tensor parallelism, a 2-D one, also
split over the tensor ranks); FSDP2 all-gathers and reduce-scatters, nothing is home-made.

What is one FSDP unit (one all-gather, one reduce-scatter): each model chunk's backbone layers together (a group,
``fully_shard([layer, ...])``), whose forward is each micro-batch's run through them; and the stage's other
parameters (on the last stage, the modules after the backbone), gathered explicitly for each step, since the user's
code calls them (or reads their weights) in its own way. A layer that shares a parameter with another module of the
stage, or appears twice, joins the other parameters.

One step, on each stage (torch.distributed.pipelining's recipe):

- Between steps every parameter, gradient and AdamW state is a shard: ``1/D`` of the stage's.
- Forwards gather each model chunk's parameters: ``"FULL_SHARD"`` gathers for each micro-batch forward and frees them
  after it, until the stage's first backward of the step; ``"SHARD_GRAD_OP"`` gathers once and keeps them.
- From the stage's first backward of the step (:meth:`FullyShardedStage.begin_backward`) to its end the parameters stay
  gathered (``set_reshard_after_backward(False)``, and ``set_reshard_after_forward(False)`` for the forwards,
  recomputes and deferred weight gradients still to come): a backward gathers at most once per step.
- The micro-batches' gradients accumulate unsharded (``set_requires_gradient_sync(False)``,
  ``set_is_last_backward(False)``); at the step's end (:meth:`FullyShardedStage.finish_backward`) one reduce-scatter per
  unit averages them over the replicas and leaves each replica its shard, and the parameters are freed. Within a
  gradient-accumulation window the reduce-scatter waits for the window's last batch.

Checkpoints: a ``"sharded"`` one is torch.distributed.checkpoint's own (``DTensor`` entries, each shard written once,
read into any layout); a ``"full"`` one gathers the shards whole (:func:`whole_tensors`), and whole tensors load into
shards (:func:`placed_like`, :func:`placed_optimizer_states`). After a completed fit :meth:`FullyShardedStage.release`
gives the module back plain, as DDP leaves it.
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from lightning_gpipe._torch import children, fsdp_post_backward, make_fsdp_root, remove_fully_shard
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning import state_dict
from lightning_gpipe.lightning._lightning import torch_optimizer

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job


class _Reducing:
    """What both kinds of replica synchronisation share: :attr:`enabled`, switched off for a gradient-accumulation
    window (``Strategy.block_backward_sync``)."""

    enabled = True

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block, accumulate without reducing over the replicas (:attr:`enabled` is ``False``)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


class GradientSync(_Reducing):
    """DDP over one stage's trained module, told when the step's last backward on this stage starts.

    Args:
        module: what this stage trains: its partition, or on the last stage the whole local LightningModule
            (partition and the modules after the backbone).
        group: the stage's data-parallel process group (the ``"data_parallel"`` dimension of the mesh).
        device: the stage's device (``device_ids`` for DDP on CUDA).

    Attributes:
        enabled: ``False`` inside a gradient-accumulation window (``Strategy.block_backward_sync``): the
            gradients accumulate and are reduced with the window's last batch.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        self.ddp = DistributedDataParallel(
            module,
            device_ids=[device] if device.type == "cuda" else None,
            process_group=group,
            forward_sync_buffers=False,
            find_unused_parameters=True,
        )

    @staticmethod
    def trains(module: nn.Module) -> bool:
        """Whether ``module`` has a parameter that requires grad (DDP refuses a module without one)."""
        return any(p.requires_grad for p in module.parameters())

    def prepare(self, outputs: Iterable[Tensor]) -> None:
        """Announce the step's last backward on this stage, from ``outputs`` (the tensors it backpropagates).

        Call it right before that backward's autograd call: the reducer then averages every bucket as the call
        fills it, and the call returns with the replicas' mean gradients in ``.grad``. Does nothing while
        :attr:`enabled` is ``False``.
        """
        if self.enabled:
            self.ddp.reducer.prepare_for_backward([t for t in outputs if t.requires_grad])


def reduce_over_replicas(
    tensor: Any, reduce_op: Any, group: dist.ProcessGroup | None, replicas: int, job: "Job"
) -> Any:
    """``tensor`` reduced over a stage's ``replicas`` (its data-parallel ``group``) as DDP reduces logged values
    (``self.log(..., sync_dist=True)``): their mean (``reduce_op`` ``"mean"``, ``None`` or ``"avg"``) or sum
    (``"sum"``); unchanged for one replica or a non-tensor. The stages of one pipeline hold parts of one step, not
    copies, so they never average with each other; the logging relay copies the last stage's values to them.
    ``job``: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the all-reduce uses.

    Raises:
        ValueError: for another ``reduce_op``.
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    op = (reduce_op or "mean").lower() if isinstance(reduce_op, (str, type(None))) else reduce_op
    if op not in ("mean", "avg", "sum", dist.ReduceOp.SUM):
        raise ValueError(f"GPipeStrategy.reduce(reduce_op={reduce_op!r}): choose 'mean', 'avg' or 'sum'.")
    if not isinstance(tensor, Tensor) or replicas == 1:
        return tensor
    mean = op in ("mean", "avg")
    result = tensor.to(torch.get_default_dtype()) if mean and not tensor.is_floating_point() else tensor.clone()
    waiting.all_reduce(job, result, group=group)
    return result / replicas if mean else result


class FullyShardedStage(_Reducing):
    """FSDP2 over one stage's trained module, driven once per step (see the module docstring).

    A collective call of the stage's replicas: the replicas start from the first replica's parameters and buffers (as
    DDP starts), then each keeps its shard.

    Args:
        trained: what this stage trains: its partition, or on the last stage the whole local LightningModule.
        model_chunks: the stage's model chunks (one :class:`~lightning_gpipe.engine.Partition` per virtual stage
            held).
        mesh: the 1-D mesh of the stage's replicas (:func:`~lightning_gpipe.engine.replicas_mesh`), a slice of the job's
            mesh, so that FSDP2 shards a tensor-parallel ``DTensor`` over it too (a 2-D ``DTensor``, as torchtitan's).
        full_shard: free the gathered parameters after each forward until the step's first backward
            (``"FULL_SHARD"``); else keep them from the first forward (``"SHARD_GRAD_OP"``).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the first broadcast uses.

    Attributes:
        enabled: ``False`` inside a gradient-accumulation window: the gradients accumulate, unsharded.
    """

    def __init__(
        self,
        trained: nn.Module,
        model_chunks: Sequence[nn.Module],
        mesh: DeviceMesh,
        full_shard: bool,
        job: "Job",
    ) -> None:
        _replicate_first(trained, mesh.get_group(), job)
        for layers in units(trained, model_chunks):
            fully_shard(layers, mesh=mesh, reshard_after_forward=full_shard)
        self.root = fully_shard(_Stage(trained, model_chunks), mesh=mesh, reshard_after_forward=False)
        make_fsdp_root(self.root)
        self.full_shard = full_shard
        _accumulate(self.root, True)

    def begin_step(self) -> None:
        """Gather the parameters outside the model chunks' units for the step (on the last stage: the modules after the
        backbone); nothing where there are none. A collective call of the replicas."""
        self.root.unshard()

    def begin_backward(self) -> None:
        """At the stage's first backward of a training step: keep the parameters gathered until the step's end."""
        if self.full_shard:
            self.root.set_reshard_after_forward(False)

    def finish_backward(self) -> None:
        """At the end of a training step's backward on this stage: reduce-scatter each unit's gradients over the
        replicas (unless :attr:`enabled` is ``False``), their mean becoming each replica's shard of ``.grad``, and free
        the gathered parameters. A collective call of the replicas."""
        _end_step(self.root, reduce=self.enabled)
        if self.full_shard:
            self.root.set_reshard_after_forward(True)

    def end_evaluation_step(self) -> None:
        """After an evaluation step: free the gathered parameters (gradients accumulated so far are kept)."""
        _end_step(self.root, reduce=False)

    def release(self) -> None:
        """Gather every parameter whole and undo FSDP2 (see :func:`unshard_for_good`): the module is a plain one
        again. A collective call of the replicas."""
        _end_step(self.root, reduce=False)
        unshard_for_good(cast(nn.Module, self.root))


class _Stage(nn.Module):
    """The FSDP2 root of a stage: its trained module and its model chunks, whose units the root's lazy
    initialisation collects; the root's own parameters are the stage's parameters outside the units. Never called."""

    def __init__(self, trained: nn.Module, model_chunks: Sequence[nn.Module]) -> None:
        super().__init__()
        self.trained, self.model_chunks = trained, nn.ModuleList(model_chunks)

    def forward(self) -> None:
        """Never called: the units run in the engine's micro-batches, the rest is gathered for each step."""
        raise RuntimeError("The FSDP2 root of a pipeline stage is never called.")


def units(trained: nn.Module, model_chunks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """The FSDP units of a stage: per model chunk, its layers that hold parameters of their own alone (used by no
    other module of ``trained`` and by no other layer, and appearing once in the stage), in order; model chunks with
    none are left out. What is left out is sharded with the stage's root (gathered for each step)."""
    positions = [
        [layer for layer in children(model_chunk).values() if layer is not None] for model_chunk in model_chunks
    ]
    layers = [layer for held in positions for layer in held]  # a layer at two positions twice (children() once)
    inside = {sub for layer in layers for sub in layer.modules()}
    owners: dict[int, set[nn.Module | None]] = {}
    for layer in layers:
        for parameter in layer.parameters():
            owners.setdefault(id(parameter), set()).add(layer)
    for module in trained.modules():
        if module not in inside:
            for parameter in module.parameters(recurse=False):
                owners.setdefault(id(parameter), set()).add(None)
    counts = {layer: sum(1 for other in layers if other is layer) for layer in layers}

    def alone(layer: nn.Module) -> bool:
        parameters = list(layer.parameters())
        return bool(parameters) and counts[layer] == 1 and all(owners[id(p)] == {layer} for p in parameters)

    found = [[layer for layer in held if alone(layer)] for held in positions]
    return [own for own in found if own]


def whole_tensors(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with every ``DTensor`` gathered whole (``full_tensor``: a collective call of its replicas, in the order
    of ``state``'s keys, which every replica shares), for a ``"full"`` checkpoint; other values as they are."""
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def placed_like(values: Mapping[str, Any], template: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each whole tensor whose entry in ``template`` is a ``DTensor`` cut to that ``DTensor``'s shard
    (each replica takes its own rows, no communication: ``distribute_tensor(src_data_rank=None)``), so that a whole
    checkpoint (``"full"``, or one written without FSDP2) loads into an FSDP2 stage; other values as they are."""
    placed = dict(values)
    for key, value in values.items():
        like = template.get(key)
        if isinstance(like, DTensor) and isinstance(value, Tensor) and not isinstance(value, DTensor):
            placed[key] = distribute_tensor(
                value.to(like.device), like.device_mesh, like.placements, src_data_rank=None
            )
    return placed


def placed_optimizer_states(module: nn.Module, optimizers: Sequence[Any], states: Sequence[Any]) -> list[Any]:
    """Each optimizer's name-keyed ``states`` placed like its own state (:func:`placed_like`) where ``module``'s
    parameters are sharded; as they are otherwise."""
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return list(states)
    current = (state_dict.optimizer_state(module, torch_optimizer(optimizer)) for optimizer in optimizers)
    return [placed_like(state, like) if isinstance(state, Mapping) else state for state, like in zip(states, current)]


def _replicate_first(module: nn.Module, group: dist.ProcessGroup, job: "Job") -> None:
    """Give every replica of ``group`` the first replica's parameters and buffers (FSDP2 shards each replica's own)."""
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            data = tensor.data
            waiting.broadcast(job, data.to_local() if isinstance(data, DTensor) else data, first, group)


# --- FSDP2 at a step's end and after a fit: its internals (in lightning_gpipe/_torch.py) used as
# torch.distributed.pipelining uses them (torch/distributed/pipelining/stage.py, ``perform_reduce_grad``).


def _accumulate(root: FSDPModule, accumulating: bool) -> None:
    """Within a step (``accumulating``): gradients accumulate unsharded, parameters stay gathered after a backward,
    and no backward is the last (FSDP2's public setters, recursive over the units); outside, the reverse."""
    root.set_requires_gradient_sync(not accumulating)
    root.set_reshard_after_backward(not accumulating)
    root.set_is_last_backward(not accumulating)


def _end_step(root: FSDPModule, reduce: bool) -> None:
    """The end of a step: every unit's post-backward (``FSDPParamGroup.post_backward``: the reduce-scatter if
    ``reduce``, then freeing the gathered parameters) and the root's final callback
    (``FSDPState._root_post_backward_final_callback``: waiting for the reductions, resetting the step's state), which
    FSDP2 runs after a backward it sees whole; the pipeline's backwards are several autograd calls."""
    _accumulate(root, False)
    root.set_requires_gradient_sync(reduce)
    fsdp_post_backward(root)
    _accumulate(root, True)


def unshard_for_good(root: nn.Module) -> None:
    """Undo FSDP2 on ``root`` and its units: each ``DTensor`` parameter replaced by a plain parameter of its whole
    value (one all-gather each: a collective call of the replicas), FSDP2's hooks removed, each unit's class and state
    back as before :func:`~torch.distributed.fsdp.fully_shard` (its ``FSDP<Class>`` subclass, its entries in the
    composable state and registry); so the user's module leaves the run as a plain module, which a later run may
    shard again. FSDP2 has no public inverse."""
    whole: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in root.modules():
            for name, parameter in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if isinstance(parameter, DTensor):
                    if id(parameter) not in whole:
                        value = parameter.full_tensor()
                        whole[id(parameter)] = nn.Parameter(value, requires_grad=parameter.requires_grad)
                    module.register_parameter(name, whole[id(parameter)])
    remove_fully_shard(root)
