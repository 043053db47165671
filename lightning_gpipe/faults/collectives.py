"""The collectives the package makes, on the default process group or a given one, through the interruptible waits.

Each one is posted with ``async_op=True`` and waited for with :func:`lightning_gpipe.faults.waiting.wait` (gloo) or
:func:`lightning_gpipe.faults.waiting.poll` (NCCL), as :func:`lightning_gpipe.faults.waiting.polls` says for its
tensors' device, so a stage waiting in a collective handles signals and names a failed or stalled stage
(torch's ``broadcast_object_list`` and ``gather_object`` block in C++ instead). Objects travel
as pickled bytes in a uint8 tensor after their sizes, as in torch's object collectives; a received size is
read on the host only after that wait, so that on CUDA the read cannot block on another stage.

Each takes the run's :class:`lightning_gpipe.faults.job.Job` first: its failure board, stall watchdog and waiter.

Not covered: the collectives inside ``torch.distributed.checkpoint`` (sharded checkpoints), Lightning's own (its
per-step SIGTERM broadcast) and those of DDP or FSDP between replicas; they block until the process group's
``timeout``.
"""

import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.faults import waiting
from lightning_gpipe.faults.waiting import EVERY_STAGE

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job


def barrier(job: "Job", group: dist.ProcessGroup | None = None) -> None:
    """Wait until every process of ``group`` (``None``: all) reaches this point.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait(job, dist.barrier(group=group, async_op=True), _device(), group)


def all_reduce(job: "Job", tensor: Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` in place over every process of ``group`` (``None``: all) with ``op``.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait(job, dist.all_reduce(tensor, op, group=group, async_op=True), tensor.device, group)


def broadcast(job: "Job", tensor: Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Copy ``tensor`` from global rank ``src`` to every process of ``group`` (``None``: all), in place.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait(job, dist.broadcast(tensor, src, group=group, async_op=True), tensor.device, group)


def broadcast_object(job: "Job", obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
    """Send the picklable ``obj`` from global rank ``src`` to every process of ``group`` (``None``: all); returns it
    on every one.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    mine = dist.get_rank() == src
    peer = EVERY_STAGE if mine else job.watchdog.name_of(src)  # the others wait for the sender
    data = _bytes(obj) if mine else None
    size = torch.tensor([data.numel() if data is not None else 0], dtype=torch.int64, device=_device())  # if mine
    _wait(job, dist.broadcast(size, src, group=group, async_op=True), size.device, group, peer)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())  # arrived: read without waiting
    assert data is not None  # this process's, or the buffer for the sender's
    _wait(job, dist.broadcast(data, src, group=group, async_op=True), data.device, group, peer)
    return obj if mine else _object(data)


def gather_object(job: "Job", obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """The picklable objects of every process of ``group`` (``None``: all), in rank order, on global rank ``dst``;
    ``None`` elsewhere.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    padded, sizes = _padded(job, obj, group)
    parts = [torch.empty_like(padded) for _ in sizes] if dist.get_rank() == dst else None
    _wait(job, dist.gather(padded, parts, dst, group=group, async_op=True), padded.device, group)
    return None if parts is None else _objects(parts, sizes)


def all_gather_object(job: "Job", obj: Any) -> list[Any]:
    """The picklable objects of every process, in rank order, on every process.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    padded, sizes = _padded(job, obj)
    parts = [torch.empty_like(padded) for _ in sizes]
    _wait(job, dist.all_gather(parts, padded, async_op=True), padded.device, None)
    return _objects(parts, sizes)


def _padded(job: "Job", obj: Any, group: dist.ProcessGroup | None = None) -> tuple[Tensor, list[int]]:
    """``obj``'s bytes padded to the longest of every process's of ``group`` (a collective call), and every
    process's size."""
    data = _bytes(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=_device()) for _ in range(dist.get_world_size(group))]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=_device())
    _wait(job, dist.all_gather(sizes, mine, group=group, async_op=True), mine.device, group)
    lengths = [int(size.item()) for size in sizes]  # arrived: read without waiting
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=_device())
    padded[: data.numel()] = data
    return padded, lengths


def _wait(
    job: "Job", work: dist.Work, device: torch.device, group: dist.ProcessGroup | None, peer: str = EVERY_STAGE
) -> None:
    """Wait for the collective ``work`` on tensors of ``device`` over ``group`` with the wait
    :func:`~lightning_gpipe.faults.waiting.polls` chooses (:func:`~lightning_gpipe.faults.waiting.wait` on gloo);
    ``peer`` names
    whom it waits for in the stall watchdog's messages."""
    if waiting.polls(device, group):
        waiting.poll(job, [work], peer)
    else:
        waiting.wait(job, [work], peer)  # looked up at each call (benchmarks/waits.py puts a blocking wait there)


def _objects(parts: list[Tensor], sizes: list[int]) -> list[Any]:
    return [_object(part[:size]) for part, size in zip(parts, sizes)]


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes(obj: Any) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(_device())


def _object(data: Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())
