"""Averaging one stage's gradients over its data-parallel replicas, once per optimizer step, by torch's DDP.

Each stage's replicas (the same stage of every pipeline, its ``"dp"`` process group) hold the same
parameters and compute gradients on different shards of the data. :class:`GradientSync` wraps what this
stage trains in :class:`torch.nn.parallel.DistributedDataParallel` and lets DDP's reducer average the
gradients: bucketed, and overlapped with the step's last backward. The micro-batches' gradients accumulate
locally first; only the step's last autograd call on this stage, the one that completes its gradients, is
announced to the reducer (``reducer.prepare_for_backward``, as torch.distributed.pipelining's stages do
with DDP), so the reducer all-reduces each bucket once, as soon as that call has produced it. Parameters
whose gradients were complete before that call (a head on the last stage, layers an earlier micro-batch
used) are found by DDP's ``find_unused_parameters`` search and reduced with the first bucket; parameters no
replica gave a gradient keep ``None``, as under DDP. Within a gradient-accumulation window nothing is
announced, so the window's summed gradients are reduced once, at its end.

Forwards do not go through DDP: the engine runs the stage's layers itself (micro-batches, recomputes), so
DDP's per-forward buffer broadcast is off; the replicas start from rank 0's parameters and buffers, which
DDP broadcasts when it is built.
"""

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_gpipe.faults import collectives

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job


class GradientSync:
    """DDP over one stage's trained module, told when the step's last backward on this stage starts.

    Args:
        module: what this stage trains: its partition, or on the last stage the whole local LightningModule
            (partition and the modules after the backbone).
        group: the stage's data-parallel process group (the ``"dp"`` dimension of the mesh).
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
        self.enabled = True

    @staticmethod
    def trains(module: nn.Module) -> bool:
        """Whether ``module`` has a parameter that requires grad (DDP refuses a module without one)."""
        return any(p.requires_grad for p in module.parameters())

    @contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside the block, accumulate without averaging (:attr:`enabled` is ``False``)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

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
    collectives.all_reduce(job, result, group=group)
    return result / replicas if mean else result
