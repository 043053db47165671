"""Waiting for transfers and collectives so that signals are handled, a failed stage is noticed, and a stall named.

A wait must not block in C++ for a transfer that may never come: there Python runs no signal handler, so a
stage blocked on a neighbour that hangs could not be stopped by Ctrl-C, SIGTERM or SLURM's requeue signal, nor
read the failure board or the stall limit. How a wait ends depends on the backend, so there are two mechanisms,
and :func:`polls`, the one rule :mod:`lightning_gpipe.engine.transfer` and this module's collectives ask, says which
one the works on a device's tensors over a process group need:

- gloo (and every other backend whose ``Work.wait()`` returns once the transfer has completed): :func:`wait`.
  gloo's point-to-point works cannot be polled (``is_completed()`` stays ``False`` until ``wait()`` returns) and
  a ``wait(timeout)`` that times out closes the connection. So a helper thread of the run (a :class:`Waiter`,
  with those signals blocked) calls ``wait()``, and the main thread waits for the helper on a lock, which Python
  interrupts for signal handlers. The cost is one thread hand-off per wait (tens of microseconds);
  ``benchmarks/waits.py`` measures it against plain blocking waits. Transfers can instead be watched as they are
  posted (:meth:`Waiter.watch`): a helper thread per stream (a peer and tag) calls their ``wait()`` at once, so
  that whether they have completed can be asked without blocking (a :class:`Watched`). A send's tensors are
  freed once it has completed, long before the stage waits for it at a flush; a receive that arrived while the
  stage computed is taken with no hand-off at all (:func:`wait_watched`).
- NCCL: :func:`poll`. ``WorkNCCL.wait()`` does not wait for the transfer: it makes the calling thread's current
  CUDA stream wait for the NCCL stream and returns (for a barrier it synchronizes the stream on the host, in
  C++), and a later host read of a received tensor (``.tolist()``, ``.item()``) would block inside a CUDA
  synchronization. ``WorkNCCL.is_completed()`` instead queries the work's end event without blocking (and reports
  an asynchronous NCCL error as completion, which ``wait()`` then raises). So the calling thread polls
  ``is_completed()``, sleeping between two looks (Python runs signal handlers during ``time.sleep``), and calls
  ``wait()`` only once the work has completed: on the thread, hence the stream, that uses the tensors, and
  when it can no longer block. The current stream then only waits for transfers that have arrived, so a host
  read after the wait cannot hang on the neighbour.

Every :data:`TICK` seconds of a long wait, either way, the waiting thread also reads the failure board (a stage
that failed stops the others even when it cannot exit) and asks the stall watchdog
(:mod:`lightning_gpipe.faults.watchdog`) whether the wait has lasted too long. ``docs/scaling.md`` says how this meets
NCCL's own watchdog and timeouts.

The package's collectives (:func:`barrier`, :func:`all_reduce`, :func:`broadcast`, :func:`broadcast_object`,
:func:`gather_object`, :func:`all_gather_object`, :func:`gather_tensors`) are posted with ``async_op=True`` (or as
point-to-point works) and waited for the same way, so a stage waiting in a collective handles signals and names a
failed or stalled stage (torch's ``broadcast_object_list`` and ``gather_object`` block in C++ instead). Objects travel
as pickled bytes in a uint8 tensor after their sizes, as in torch's object collectives (tensors gathered whole, as
their own bytes); a received size is read on the host only after that
wait, so that on CUDA the read cannot block on another stage. Not covered: the collectives inside
``torch.distributed.checkpoint`` (sharded checkpoints), Lightning's own (its per-step SIGTERM broadcast) and those of
DDP or FSDP between replicas; they block until the process group's ``timeout``.

The waits take the run's :class:`lightning_gpipe.faults.job.Job` (its failure board, position, stall watchdog and
:class:`Waiter`; see :class:`WaitingJob`) as their first argument; the module keeps no state of its own.
"""

import pickle
import queue
import signal
import threading
import time
from collections.abc import Hashable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.faults.failure import FailureBoard
from lightning_gpipe.faults.watchdog import Position, Watchdog

TICK = 1.0
"""Seconds between two looks at the failure board and the stall limit while a wait lasts."""

EVERY_STAGE = "every stage"
"""The peer of a collective."""

POLLED_BACKENDS = frozenset({"nccl"})
"""Backends whose ``Work.wait()`` orders a device stream instead of waiting for the transfer: :func:`poll`."""

_FIRST_PAUSE = 20e-6
"""Seconds :func:`poll` sleeps after its first look at a work that has not completed; each pause doubles the last."""

_LONGEST_PAUSE = 1e-3
"""Seconds of :func:`poll`'s longest pause: a long wait costs about a thousand looks (a CUDA event query) a second."""


def polls(device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
    """Whether works on tensors of ``device`` over ``group`` are waited for with :func:`poll` (else :func:`wait`).

    The one place that chooses the mechanism: :func:`poll` for a backend in :data:`POLLED_BACKENDS` (NCCL), whose
    ``Work.wait()`` returns before the transfer has completed; :func:`wait` for the others (gloo). Tensors on the
    CPU never go through NCCL, so the answer for them needs no process group.

    Args:
        device: the device of the tensors the works send or receive.
        group: the process group of the works (``None``: the default group); for a group with a backend per device
            type (``"cpu:gloo,cuda:nccl"``) the backend of ``device``'s type counts.

    Raises:
        ValueError: for a device other than the CPU, if the default process group is not initialised or this
            process is not in ``group``.
    """
    if device.type == "cpu":
        return False
    config = dist.get_backend_config(group)  # "cuda:nccl", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:nccl"
    backends = dict(
        part.split(":", 1) if ":" in part else (device.type, part)  # type: ignore[misc]  # dict() takes list pairs
        for part in config.split(",")
    )
    return backends.get(device.type) in POLLED_BACKENDS


class _Works:
    """Works to wait for, and how the waiter tells it is done."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


class _Thread(threading.Thread):
    """Waits for the works of each batch in turn, then releases the batch's lock; ends at a ``None``."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="lightning-gpipe-waiter")
        self.batches: queue.SimpleQueue[_Works | None] = queue.SimpleQueue()

    def run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP})
        for batch in iter(self.batches.get, None):
            _finish(batch)


def _finish(batch: _Works) -> None:
    """Wait for ``batch``'s works, keep the first error for the main thread, then drop the works (a gloo work holds
    its tensor: the batch that stays referenced until the next one arrives must not keep it alive) and release."""
    try:
        for work in batch.works:
            work.wait()
    except BaseException as error:  # handed to the main thread, which raises it
        batch.error = error
    batch.works = []
    batch.done.release()


class Watched:
    """A work a helper thread of a :class:`Waiter` waits for (see :meth:`Waiter.watch`), as a work whose completion
    can be asked without blocking and that can be waited for any number of times: what a gloo work is not."""

    def __init__(self, batch: _Works) -> None:
        self._batch = batch

    def is_completed(self) -> bool:
        """Whether the helper thread's ``wait()`` of the works has returned (or raised)."""
        return not self._batch.done.locked()

    def wait(self) -> bool:
        """Block until the works have completed; raise the error of a failed one, every time this is called."""
        self._batch.done.acquire()  # held by the helper thread until its wait() returned
        self._batch.done.release()
        if self._batch.error is not None:
            raise self._batch.error
        return True


class Waiter:
    """The helper threads that call ``Work.wait()`` for :func:`wait` and :meth:`watch`, one set per run (part of its
    :class:`~lightning_gpipe.faults.job.Job`): one thread for the waits, one per stream of watched sends, each started
    at its first batch and ended by :meth:`close`. A batch after :meth:`close` starts a new thread. A copy in another
    process (a pickled strategy) starts its own."""

    def __init__(self) -> None:
        self._threads: dict[Hashable | None, _Thread] = {}

    def submit(self, works: list[dist.Work], stream: Hashable | None = None) -> _Works:
        """Hand ``works`` to the thread of ``stream`` (``None``: the waits'); the returned batch's ``done`` lock is
        released once they completed. A thread waits for its batches in the order they were handed."""
        batch = _Works(works)
        thread = self._threads.get(stream)
        if thread is None or not thread.is_alive():
            thread = self._threads[stream] = _Thread()
            thread.start()
        thread.batches.put(batch)
        return batch

    def watch(self, works: list[dist.Work], stream: Hashable) -> Watched:
        """Have ``works``, sends to or receives from one peer on one tag (a ``stream``), waited for at once by that
        stream's thread, for backends whose works cannot be polled (gloo: ``is_completed()`` stays ``False`` until
        ``wait()`` returns, and a second ``wait()`` of a completed send blocks). A stream's transfers complete in
        the order they were posted (the peer posts its side in that order), so its thread adds no wait to any.

        Returns:
            The works as one :class:`Watched`: ask it, rather than the works, whether they completed, and wait for
            it rather than for them.
        """
        return Watched(self.submit(works, stream))

    def close(self) -> None:
        """End the helper threads once each has waited for what it was handed (it does not wait for that here)."""
        threads, self._threads = self._threads, {}
        for thread in threads.values():
            thread.batches.put(None)

    def __getstate__(self) -> dict[str, Any]:
        return {"_threads": {}}  # a thread does not cross processes


class WaitingJob(Protocol):
    """What the waits need of the run's :class:`lightning_gpipe.faults.job.Job` (which imports this module)."""

    board: FailureBoard
    position: Position
    watchdog: Watchdog
    waiter: Waiter


def wait(job: WaitingJob, works: list[dist.Work], peer: str) -> None:
    """Wait until every work in ``works`` has completed, handling signals meanwhile: the job's helper thread
    (:class:`Waiter`) calls ``Work.wait()``, for backends whose ``wait()`` returns once the transfer has completed
    (gloo; see :func:`polls`).

    Args:
        job: the run's job: its waiter, failure board, position and stall watchdog.
        works: works of point-to-point transfers or asynchronous collectives (``async_op=True``).
        peer: whom the works wait for, for the position and messages: ``"stage 0"``, or :data:`EVERY_STAGE`.

    Raises:
        PipelineFailure: if a transfer failed (naming the published cause), another stage published a
            failure while this one waited, or the wait lasted longer than the stall limit (naming the
            stage that stopped progressing).
    """
    if not works:
        return
    batch = job.waiter.submit(works)
    _block(job, batch, peer)
    if batch.error is not None:
        job.board.raise_failure(batch.error, job.watchdog.last_positions)


def wait_watched(job: WaitingJob, watched: "Watched", peer: str) -> None:
    """Wait until a helper thread of the job has seen ``watched``'s works complete (they were handed to it when they
    were posted, :meth:`Waiter.watch`), handling signals meanwhile, as :func:`wait` does, without handing anything
    over now: a transfer that has arrived while the stage computed costs no wait at all.

    Args:
        job: the run's job: its failure board, position and stall watchdog.
        watched: receives posted ahead and watched since.
        peer: whom the works wait for, for the position and messages.

    Raises:
        PipelineFailure: as :func:`wait`.
    """
    batch = watched._batch
    if not batch.done.acquire(blocking=False):
        _block(job, batch, peer)
    batch.done.release()
    if batch.error is not None:
        job.board.raise_failure(batch.error, job.watchdog.last_positions)


def _block(job: WaitingJob, batch: _Works, peer: str) -> None:
    """Block until ``batch`` is done (its lock acquired), reading the failure board and the stall limit every
    :data:`TICK` seconds; the position says the stage waits for ``peer`` meanwhile.

    Raises:
        PipelineFailure: as :func:`wait`.
    """
    started = time.monotonic()
    with job.position.waiting(peer):
        try:
            while not batch.done.acquire(timeout=TICK):
                _check(job, peer, time.monotonic() - started)
        except RuntimeError as error:
            job.board.raise_failure(error, job.watchdog.last_positions)


def wait_completed(job: WaitingJob, works: list) -> None:
    """Wait, on this thread, for ``works`` that have completed (an NCCL work or a :class:`Watched` whose
    ``is_completed()`` said so): their ``wait()`` returns at once, or raises the error of a failed transfer.

    Args:
        job: the run's job (its failure board names the cause of a failed transfer).
        works: works that have completed.

    Raises:
        PipelineFailure: if a transfer failed (naming the published cause).
    """
    try:
        for work in works:
            work.wait()
    except RuntimeError as error:
        job.board.raise_failure(error, job.watchdog.last_positions)


def poll(job: WaitingJob, works: list[dist.Work], peer: str) -> None:
    """Wait until every work in ``works`` has completed by polling ``Work.is_completed()`` on this thread, handling
    signals meanwhile, then call each work's ``wait()``: for backends whose ``wait()`` returns before the transfer
    has completed (NCCL; see :func:`polls`).

    The first look costs no sleep; after it the thread sleeps between two looks (from 20 microseconds, doubling up
    to a millisecond), and reads the failure board and the stall limit every :data:`TICK` seconds. ``wait()`` is
    called only once a work has completed, on the calling thread: it then makes the current CUDA stream wait for
    a transfer that has arrived (it cannot block), and raises the work's error. So a host read of a received
    tensor afterwards (``.tolist()``, ``.item()``) waits for the kernels queued on the stream, not for the peer.

    Args:
        job: the run's job: its failure board, position and stall watchdog.
        works: works of point-to-point transfers or asynchronous collectives (``async_op=True``).
        peer: whom the works wait for, for the position and messages: ``"stage 0"``, or :data:`EVERY_STAGE`.

    Raises:
        PipelineFailure: if a transfer failed (naming the published cause; NCCL reports an asynchronous error as
            completion, and ``wait()`` raises it), another stage published a failure while this one waited, or the
            wait lasted longer than the stall limit (naming the stage that stopped progressing).
    """
    if not works:
        return
    with job.position.waiting(peer), job.board.as_pipeline_failure(detail=job.watchdog.last_positions):
        pending = _pending(works)
        if pending:
            started = time.monotonic()
            pause, look = _FIRST_PAUSE, started + TICK
            while pending:
                time.sleep(pause)  # Python runs signal handlers here; a handler's exception ends the wait
                pending = _pending(pending)
                pause = min(2 * pause, _LONGEST_PAUSE)
                now = time.monotonic()
                if pending and now >= look:
                    _check(job, peer, now - started)
                    look = now + TICK
        for work in works:
            work.wait()  # completed: orders the current stream after the transfer without blocking; raises its error


def _pending(works: list[dist.Work]) -> list[dist.Work]:
    """``works`` from the first one that has not completed on (the later ones are looked at once it has)."""
    for i, work in enumerate(works):
        if not work.is_completed():
            return works[i:]
    return []


def _check(job: WaitingJob, peer: str, waited: float) -> None:
    """Raise if the job failed elsewhere or this wait counts as a stall."""
    board, watchdog = job.board, job.watchdog
    cause = board.published_cause()
    if cause is not None:
        raise board.stopped_because(cause)
    if waited <= watchdog.limit:
        return
    stall = watchdog.diagnose(peer, waited)
    if stall is None:
        return
    message, culprit = stall
    cause = board.publish(message) or message
    if culprit is not None:
        watchdog.mark_stalled(culprit)
    raise board.stopped_because(cause)


# The package's collectives (see the module docstring), on the default process group or a given one.


def barrier(job: WaitingJob, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every process of ``group`` (``None``: all) reaches this point.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait_collective(job, dist.barrier(group=group, async_op=True), _device(), group)


def all_reduce(job: WaitingJob, tensor: Tensor, op=dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` in place over every process of ``group`` (``None``: all) with ``op``.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait_collective(job, dist.all_reduce(tensor, op, group=group, async_op=True), tensor.device, group)


def broadcast(job: WaitingJob, tensor: Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Copy ``tensor`` from global rank ``src`` to every process of ``group`` (``None``: all), in place.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    _wait_collective(job, dist.broadcast(tensor, src, group=group, async_op=True), tensor.device, group)


def broadcast_object(job: WaitingJob, obj: Any, src: int, group: dist.ProcessGroup | None = None) -> Any:
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
    _wait_collective(job, dist.broadcast(size, src, group=group, async_op=True), size.device, group, peer)
    if not mine:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=_device())  # arrived: read without waiting
    assert data is not None  # this process's, or the buffer for the sender's
    _wait_collective(job, dist.broadcast(data, src, group=group, async_op=True), data.device, group, peer)
    return obj if mine else _object(data)


def gather_object(job: WaitingJob, obj: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """The picklable objects of every process of ``group`` (``None``: all), in rank order, on global rank ``dst``;
    ``None`` elsewhere.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    padded, sizes = _padded(job, obj, group)
    parts = [torch.empty_like(padded) for _ in sizes] if dist.get_rank() == dst else None
    _wait_collective(job, dist.gather(padded, parts, dst, group=group, async_op=True), padded.device, group)
    return None if parts is None else _objects(parts, sizes)


def all_gather_object(job: WaitingJob, obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """The picklable objects of every process of ``group`` (``None``: all), in rank order, on every one of them.

    Args are those of the torch.distributed collective, after ``job``: the run's job.

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    padded, sizes = _padded(job, obj, group)
    parts = [torch.empty_like(padded) for _ in sizes]
    _wait_collective(job, dist.all_gather(parts, padded, group=group, async_op=True), padded.device, group)
    return _objects(parts, sizes)


def gather_tensors(
    job: WaitingJob, tensors: list[Tensor], dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[list[Tensor]] | None:
    """Every process's ``tensors`` of ``group`` (``None``: all), in rank order, on global rank ``dst``, on the CPU;
    ``None`` elsewhere.

    Unlike :func:`gather_object`, nothing is pickled or padded: each tensor crosses as its own bytes, one
    point-to-point transfer each (on the device the backend sends from), and ``dst`` receives one tensor at a time
    into the memory it returns. So gathering a whole model on one process costs that process the model and no copy
    of it, and the senders nothing (beyond a contiguous copy of a tensor that is not, and over NCCL a device copy of
    a CPU one).

    Args are those of :func:`gather_object`; ``tensors``: dense tensors of any shape, dtype and device (not
    quantized, not sparse).

    Raises:
        PipelineFailure: if another process failed or stalled meanwhile.
    """
    device = _device()
    specs = gather_object(job, [(tensor.shape, tensor.dtype) for tensor in tensors], dst, group)
    if specs is None:
        sends = [_as_bytes(tensor, device) for tensor in tensors]
        posted = [dist.isend(data, dst, group=group, tag=tag) for tag, data in enumerate(sends) if data.numel()]
        _wait_works(job, [work for work in posted if work is not None], device, group, job.watchdog.name_of(dst))
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    return [
        [tensor.detach().cpu() for tensor in tensors] if rank == dst else _received(job, rank, shapes, device, group)
        for rank, shapes in zip(ranks, specs)
    ]


def _received(
    job: WaitingJob, src: int, specs: list[tuple[torch.Size, torch.dtype]], device: torch.device, group: Any
) -> list[Tensor]:
    """The tensors of shapes and dtypes ``specs`` that global rank ``src`` sends (:func:`gather_tensors`), on the
    CPU."""
    received = []
    for tag, (shape, dtype) in enumerate(specs):
        data = torch.empty(shape.numel() * dtype.itemsize, dtype=torch.uint8, device=device)
        if data.numel():
            work = dist.irecv(data, src, group=group, tag=tag)
            assert work is not None  # this process is in ``group``
            _wait_works(job, [work], device, group, job.watchdog.name_of(src))
        received.append(data.cpu().view(dtype).reshape(shape))
    return received


def _as_bytes(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor``'s elements in order, as bytes on ``device``."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).to(device)


def _padded(job: WaitingJob, obj: Any, group: dist.ProcessGroup | None = None) -> tuple[Tensor, list[int]]:
    """``obj``'s bytes padded to the longest of every process's of ``group`` (a collective call), and every
    process's size."""
    data = _bytes(obj)
    sizes = [torch.zeros(1, dtype=torch.int64, device=_device()) for _ in range(dist.get_world_size(group))]
    mine = torch.tensor([data.numel()], dtype=torch.int64, device=_device())
    _wait_collective(job, dist.all_gather(sizes, mine, group=group, async_op=True), mine.device, group)
    lengths = [int(size.item()) for size in sizes]  # arrived: read without waiting
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=_device())
    padded[: data.numel()] = data
    return padded, lengths


def _wait_collective(
    job: WaitingJob, work: dist.Work, device: torch.device, group: dist.ProcessGroup | None, peer: str = EVERY_STAGE
) -> None:
    """Wait for the collective ``work`` on tensors of ``device`` over ``group`` with the wait
    :func:`polls` chooses (:func:`wait` on gloo);
    ``peer`` names
    whom it waits for in the stall watchdog's messages."""
    _wait_works(job, [work], device, group, peer)


def _wait_works(
    job: WaitingJob, works: list[dist.Work], device: torch.device, group: dist.ProcessGroup | None, peer: str
) -> None:
    """Wait for ``works`` on tensors of ``device`` over ``group`` with the wait :func:`polls` chooses."""
    if polls(device, group):
        poll(job, works, peer)
    else:
        wait(job, works, peer)  # looked up at each call (benchmarks/waits.py puts a blocking wait there)


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
