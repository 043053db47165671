"""One optimizer step, agreed by every stage: the global gradient norm and the shared found-inf decision.

Each stage steps its own optimizer over its own parameters. Two decisions of a
step depend on all the gradients of the model, not one stage's part:

- clipping by norm scales every gradient by ``max_norm / total_norm``, where
  ``total_norm`` is the norm over all stages' gradients (what single-device
  ``torch.nn.utils.clip_grad_norm_`` computes over the whole model);
- with a gradient scaler (``precision="16-mixed"``), a non-finite gradient on
  any stage must make every stage skip the step and back off the scale together,
  or the stages' weights and scales drift apart.

Clipping by value needs nothing: it is element-wise. :func:`pipelined` gives the strategy's precision plugin both.
"""

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_gpipe._torch import found_inf_per_device, scaler_device
from lightning_gpipe.faults import waiting
from lightning_gpipe.lightning._lightning import set_plugin_class

if TYPE_CHECKING:
    from lightning_gpipe.engine import Topology
    from lightning_gpipe.faults import Job


def clip_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    uncounted: Iterable[Tensor] = (),
    *,
    job: Optional["Job"],
    holders: int = 1,
) -> Tensor:
    """Clip this stage's gradients by the 2-norm of the gradients of every stage in ``group``.

    Equals ``torch.nn.utils.clip_grad_norm_`` over the whole model: the squared norms of
    the stages are summed (an all-reduce; every stage must call this), then each stage
    scales its gradients as ``torch.nn.utils.clip_grads_with_norm_`` does. A gradient spread over several processes
    (a ``DTensor``: FSDP2's over the data-parallel replicas, :mod:`~lightning_gpipe.lightning.data_parallel`, or
    tensor parallelism's, :mod:`~lightning_gpipe.lightning.tensor_parallel`) counts and is scaled by its local part,
    so then ``group`` must be every process and ``holders`` the processes that hold each stage: a local part's
    squared norm is weighted by the number of distinct parts (the sizes of its sharded mesh dimensions) over
    ``holders``, so that each element counts once whatever holds copies of it.

    Args:
        parameters: this stage's parameters (their ``.grad`` is scaled in place).
        max_norm: the largest allowed 2-norm of all gradients together.
        group: the stages of one pipeline, or with sharding or tensor parallelism every process; ``None`` is the
            default (whole-world) group.
        uncounted: parameters among ``parameters`` whose gradients are scaled but left out of this stage's norm:
            the copies of a tied parameter held by several stages, on all of them but one, so that it counts
            once (see :meth:`lightning_gpipe.engine.ties.TiedParameters.uncounted`). None by default.
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the all-reduce uses; ``None`` only when
            torch.distributed is not initialised (one process).
        holders: the processes of ``group`` that hold each stage (1, default: one per stage; D under FSDP2, D * T
            with tensor parallelism).

    Returns:
        The total 2-norm before clipping (a scalar tensor on this stage's device).

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    skipped = {id(p) for p in uncounted}
    grads = [(p.grad, id(p) not in skipped) for p in parameters if p.grad is not None]
    weighted: dict[float, list[Tensor]] = {}
    for grad, counts in grads:
        if counts:
            weighted.setdefault(_parts(grad) / holders, []).append(_local(grad))
    device = next(iter(weighted.values()))[0].device if weighted else torch.device("cpu")
    squared = torch.zeros((), device=device, dtype=torch.float64)
    dtype = torch.float32
    for weight, locals_ in weighted.items():  # one weight of 1.0 without tensor parallelism: one norm, as torch's
        norm = torch.nn.utils.get_total_norm(locals_)
        squared, dtype = squared + weight * norm.double() ** 2, norm.dtype
    if dist.is_initialized():
        assert job is not None, "clip_grad_norm_ needs the run's job once torch.distributed is initialised"
        waiting.all_reduce(job, squared, group=group)
    total = squared.sqrt().to(dtype)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grads_with_norm_'s
    for grad, _ in grads:
        _local(grad).mul_(coefficient.to(grad.device))
    return total


def _parts(tensor: Tensor) -> int:
    """The distinct parts a ``DTensor`` is cut into (the product of the sizes of its mesh dimensions that split it:
    every placement but a replicated one, FSDP2's strided shards over tensor-parallel ones included), else 1."""
    if not isinstance(tensor, DTensor):
        return 1
    mesh = tensor.device_mesh
    return math.prod(mesh.size(dim) for dim, placement in enumerate(tensor.placements) if not placement.is_replicate())


def _local(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s shard on this process (which scaling in place scales), else ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class SharedGradScaler(torch.amp.GradScaler):
    """A gradient scaler whose found-inf decision is shared by every stage of the pipeline.

    After unscaling, each stage's "found a non-finite gradient" flag is all-reduced with
    ``MAX``, so the optimizer steps of all stages are skipped together and the scale backs
    off on every stage alike, as with one scaler over the whole model. Build it with
    :meth:`from_scaler` from the precision plugin's scaler.

    Args:
        group: the stages of one pipeline; ``None`` is the default (whole-world) group.
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the all-reduce uses; ``None`` only when
            torch.distributed is not initialised.
        *args: as for :class:`torch.amp.GradScaler`.
        **kwargs: as for :class:`torch.amp.GradScaler`.
    """

    def __init__(self, *args, group: dist.ProcessGroup | None = None, job: Optional["Job"] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group, self.job = group, job

    @classmethod
    def from_scaler(
        cls, scaler: torch.amp.GradScaler, group: dist.ProcessGroup | None = None, job: Optional["Job"] = None
    ) -> "SharedGradScaler":
        """A shared scaler with the device, settings and current state (scale, growth tracker) of ``scaler``, over
        ``group`` with the waits of ``job`` (see the class's arguments)."""
        shared = cls(scaler_device(scaler), enabled=scaler.is_enabled(), group=group, job=job)
        shared.load_state_dict(scaler.state_dict())
        return shared

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients, then agree with the other stages on whether any was non-finite.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        super().unscale_(optimizer)
        found = found_inf_per_device(self, optimizer)
        if not found or not dist.is_initialized():
            return
        flags = list(found.values())
        any_found = torch.stack([flag.to(flags[0].device) for flag in flags]).amax()
        assert self.job is not None, "SharedGradScaler needs the run's job once torch.distributed is initialised"
        waiting.all_reduce(self.job, any_found, dist.ReduceOp.MAX, self.group)
        for flag in flags:
            flag.copy_(any_found)


class PipelinePrecision:
    """What :func:`pipelined` mixes into a precision plugin: Lightning's gradient clipping by norm goes through
    :func:`clip_grad_norm_` over the stages of ``pipeline_group``, leaving out ``uncounted()`` (tied copies), with
    the waits of ``job`` (the run's). Set on the instance by :func:`pipelined`."""

    pipeline_group: dist.ProcessGroup | None
    uncounted: Callable[[], Iterable[Tensor]]
    job: "Job"
    holders: int
    main_params: Callable[[Any], Iterable[Tensor]]  # the precision plugin's own method (the mixed class's base)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Clip ``optimizer``'s gradients by the norm of every stage's gradients (a collective call of the pipeline)."""
        parameters, group, uncounted = self.main_params(optimizer), self.pipeline_group, self.uncounted()
        clip_grad_norm_(parameters, clip_val, group=group, uncounted=uncounted, job=self.job, holders=self.holders)


@functools.cache
def _pipelined_class(plugin_class: type) -> type:
    return type(f"Pipelined{plugin_class.__name__}", (PipelinePrecision, plugin_class), {})


def pipelined(
    plugin: Any,
    group: dist.ProcessGroup | None,
    uncounted: Callable[[], Iterable[Tensor]],
    job: "Job",
    holders: int | None = None,
) -> None:
    """Make a Lightning precision plugin clip by the norm of all stages' gradients and share its gradient scaler's
    found-inf decision (:class:`SharedGradScaler`); undone by :func:`unpipelined`.

    The plugin's class becomes a subclass of its own class with :class:`PipelinePrecision` first, so every
    ``isinstance`` check of Lightning's (``MixedPrecision``, ``FSDPPrecision``...) still holds.

    Args:
        plugin: the strategy's precision plugin.
        group: the stages of this process's pipeline.
        uncounted: returns the parameters left out of this stage's norm (see :func:`clip_grad_norm_`).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the all-reduces use.
        holders: ``None`` (default) where each stage's gradients are whole on every process that holds it; where
            they are spread over processes (sharded over the replicas by FSDP2, :mod:`~lightning_gpipe.lightning.
            data_parallel`, or split by tensor parallelism), the processes that hold each stage (:func:`holders`):
            the norm is then summed over every process, each element once.

    Raises:
        ValueError: with ``holders``, for a plugin with a gradient scaler (``precision="16-mixed"``), whose
            unscaling of spread gradients has not been run.
    """
    if holders is not None and getattr(plugin, "scaler", None) is not None:
        raise ValueError(
            "GPipeStrategy(sharding_strategy=... or tensor_parallel_size > 1) with precision='16-mixed': the gradient"
            " scaler's unscaling of sharded or tensor-parallel gradients has not been run by GPipeStrategy; use"
            " precision='bf16-mixed' (no scaler) or '32-true', or sharding_strategy='NO_SHARD' and"
            " tensor_parallel_size=1."
        )
    group = None if holders is not None else group
    if not isinstance(plugin, PipelinePrecision):
        plugin_class: type = type(plugin)  # a class, hashable (mypy reads type(Any) as type[Any], maybe unhashable)
        set_plugin_class(plugin, _pipelined_class(plugin_class))
    plugin.pipeline_group, plugin.uncounted, plugin.job, plugin.holders = group, uncounted, job, holders or 1
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, SharedGradScaler):
        plugin.scaler = SharedGradScaler.from_scaler(scaler, job=job)
    elif scaler is not None:
        scaler.job = job  # a scaler shared in an earlier run, with its state


def unpipelined(plugin: Any) -> None:
    """Give ``plugin`` its own class back (after a run; its scaler stays shared, with its state)."""
    if isinstance(plugin, PipelinePrecision):
        set_plugin_class(plugin, type(plugin).__bases__[1])
        del plugin.pipeline_group, plugin.uncounted, plugin.job, plugin.holders


def holders(topology: "Topology", fully_sharded: bool) -> int | None:
    """The processes that hold each stage where its gradients are spread over them (:func:`pipelined`'s
    ``holders``): ``D * T`` when FSDP2 shards them (``fully_sharded``) or with tensor parallelism; else ``None``."""
    if not fully_sharded and topology.tensor_parallel_size == 1:
        return None
    return topology.data_parallel_size * topology.tensor_parallel_size
