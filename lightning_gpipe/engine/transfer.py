"""Point-to-point transfer of activations and gradients between neighbouring stages.

Every activation message starts with a shape header, so shapes may change from
step to step and between micro-batches (variable-length text, uneven last
micro-batch). Gradients need no header: the receiver of a gradient is the stage
that sent the activation, so it already knows the shapes.

Wire format of one micro-batch's activation (a fixed-size int64 header, then the tensors)::

    [micro_batches, index, is_tuple, n, (dtype, ndim, *shape) * n, 0 ...]   tensor_0 ... tensor_{n-1}

``micro_batches`` is the number of micro-batches of the current mini-batch, so that stages
after the first learn it from the first message, and ``index`` says which one this is.

Latency matters as much as bandwidth: a blocked receive costs a wake-up (up to a
scheduler tick on a busy CPU), and gloo moves a payload only once its receive is
posted. So receives are posted ahead: the next micro-batch's header while this
one computes, all payload tensors of a micro-batch at once, and a gradient before
the drain needs it. On gloo a helper thread of the run waits for each expected header and posts its payload's
receives as soon as it has arrived (:class:`_Arrival`), so the payload too moves while the stage computes, not
once the stage reads the header; on NCCL, whose communicator is not for two threads, the stage reads it itself.
Sends are asynchronous and overlap compute. A send keeps its
tensors alive until it has completed (once its receiver has posted the receive, and
the bytes have gone); the link drops the sends that have completed whenever it posts
a new one and at a flush, so a sent output or gradient is freed soon after its
receiver took it, not at the next flush (under fill-drain, the end of the step). Whether
a send has completed is asked without blocking: NCCL's works answer themselves, gloo's
through a helper thread that waits for each send as it goes
(:meth:`~lightning_gpipe.faults.waiting.Waiter.watch`). Works with any
torch.distributed backend that has ``isend``/``irecv`` (gloo on CPU, NCCL on GPU);
receives are posted in the order the matching sends are issued, as NCCL needs.
Waits go through :mod:`lightning_gpipe.faults.waiting`, so a stage waiting for a neighbour handles signals and
names a failed or stalled neighbour: :func:`~lightning_gpipe.faults.waiting.wait` on gloo (an activation's payload,
which its sender sends in the same call as the header already received, with
:func:`~lightning_gpipe.faults.waiting.wait_in_flight`), :func:`~lightning_gpipe.faults.waiting.poll` on NCCL, as
:func:`~lightning_gpipe.faults.waiting.polls` says for the link's device. Either way a header is read on the host
only once it has arrived, so that on CUDA the read cannot block on a neighbour.

Where two neighbouring model chunks are on one process (where ZB-V's V turns, :func:`~lightning_gpipe.engine.actions.
virtual_stage`), their link is a :class:`Turn`: what one model chunk sends the other takes, in order, without a
transfer.

Every send and every wait is recorded as a ``send`` or ``recv`` span of the link's
:class:`~lightning_gpipe.engine.events.Recorder` (shared with its stage), for the pipeline callbacks.
"""

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import microbatch

from lightning_gpipe.faults import waiting
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.microbatch import Value

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job

Meta = tuple[torch.Size, torch.dtype]
"""Shape and dtype of a tensor whose gradient will arrive."""

HEADER_SLOTS = 128
"""int64 slots of an activation header: room for 20 four-dimensional tensors per activation."""

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


class Link:
    """The connections of one stage to the stage before and the stage after it.

    Args:
        prev_rank: global rank of the previous stage, ``None`` on the first stage.
        next_rank: global rank of the next stage, ``None`` on the last stage.
        device: device of this stage; headers and received tensors are put there.
        events: where sends and waits are recorded as spans; a new (disabled) recorder by default.
        tag: the point-to-point tag of every message, so that two links between the same pair of ranks (a
            stage's neighbour link and a skip connection's, :mod:`lightning_gpipe.engine.skip.links`, or two model
            model chunks' links under virtual stages) do not mix; 0 by default. A pair ``(previous, next)`` gives the
            messages with each neighbour their own tag (under virtual stages, the two neighbours may be one
            rank). NCCL ignores tags: there two such links need process groups of their own (``groups``).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the link's waits are (failure board, stall
            watchdog, names of the neighbours).
        groups: the process groups of the messages with the previous and the next stage
            (:mod:`lightning_gpipe.engine.channels`); ``None`` (default): the default group.
        turns: the :class:`Turn` with the previous and the next stage where that stage is a model chunk of the same
            process (``None``, default: a transfer).
    """

    def __init__(
        self,
        prev_rank: Optional[int],
        next_rank: Optional[int],
        device: torch.device,
        events: Optional[Recorder] = None,
        tag: Union[int, tuple[int, int]] = 0,
        *,
        job: "Job",
        groups: tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]] = (None, None),
        turns: tuple[Optional["Turn"], Optional["Turn"]] = (None, None),
    ) -> None:
        self.device = device
        self._turns = turns
        self.events = events if events is not None else Recorder()
        prev_tag, next_tag = tag if isinstance(tag, tuple) else (tag, tag)
        self._prev, self._next = _Peer(prev_rank, prev_tag, groups[0]), _Peer(next_rank, next_tag, groups[1])
        self.job = job
        self._pending_sends: list[_Send] = []  # posted, not known to have completed: their tensors kept alive
        self._arrival: Optional[tuple[_Arrival, Optional[waiting.Watched]]] = None  # the next activation expected
        self._grads: list[tuple[list[dist.Work], list[Tensor]]] = []
        self._polled = waiting.polls(device)  # how its waits end: polled on NCCL, a helper thread on gloo

    def send_activation(self, value: Value, index: int, micro_batches: int) -> None:
        """Send micro-batch ``index`` of ``micro_batches`` (a Tensor or tuple of tensors) to the next stage,
        asynchronously.

        Raises:
            ValueError: if the activation's shapes do not fit in :data:`HEADER_SLOTS`, or a dtype cannot be sent.
            PipelineFailure: if an earlier send of this link failed.
        """
        with self.events.span("send", index):
            if self._turns[1] is not None:
                self._turns[1].activations.append((microbatch.leaves(value, False, self.device), micro_batches))
            else:
                self._send_activation(value, index, micro_batches)

    def _send_activation(self, value: Value, index: int, micro_batches: int) -> None:
        tensors = microbatch.tensors(value)
        header = [micro_batches, index, int(not isinstance(value, Tensor)), len(tensors)]
        for tensor in tensors:
            if tensor.dtype not in _DTYPES:
                raise ValueError(f"Cannot send a {tensor.dtype} tensor between stages; use one of {_DTYPES}.")
            header += [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape]
        if len(header) > HEADER_SLOTS:
            raise ValueError(
                f"An activation of {len(tensors)} tensors is too large to describe in {HEADER_SLOTS} header slots;"
                " pass fewer tensors between layers (e.g. stack them)."
            )
        header += [0] * (HEADER_SLOTS - len(header))
        wires = [_wire(tensor.detach()) for tensor in tensors]  # before the header: nothing can fail between
        header_tensor = torch.tensor(header, dtype=torch.int64, device=self.device)
        self._post([header_tensor, *wires], self._next, index)

    def recv_activation(self) -> tuple[Value, int]:
        """Receive the next micro-batch's input from the previous stage.

        Returns:
            ``(value, micro_batches)``: the activation (Tensor or tuple, as sent) and M.

        Raises:
            PipelineFailure: if the previous stage failed while this one waited for it.
        """
        if self._turns[0] is not None:
            with self.events.span("recv"):
                return self._turns[0].take(self._turns[0].activations)
        start = time.perf_counter()
        if self._arrival is None:
            self._arrival = self._expect()
        arrival, watched = self._arrival
        if self._polled:  # the header read once it has arrived, so that the host read cannot block on the peer
            self._wait([arrival.header_work], self._prev.rank)
            arrival.post_payload()
            self._wait(arrival.works, self._prev.rank, in_flight=True)  # sent with the header: only bytes to come
        elif watched.is_completed():
            waiting.wait_in_flight(self.job, [watched])
        else:
            self._wait([watched], self._prev.rank)
        # the next one expected once this one's payload is posted, so that it matches the next header on any backend
        self._arrival = self._expect() if arrival.index + 1 < arrival.micro_batches else None
        self.events.add("recv", arrival.index, start, time.perf_counter())
        return arrival.value(), arrival.micro_batches

    def send_grads(self, grads: list[Tensor], index: int) -> None:
        """Send the gradients of micro-batch ``index``'s floating-point inputs back to the previous stage,
        asynchronously.

        Raises:
            PipelineFailure: if an earlier send of this link failed.
        """
        with self.events.span("send", index):
            if self._turns[0] is not None:
                self._turns[0].gradients.append([microbatch.leaves(grad, False, self.device) for grad in grads])
            else:
                self._post([grad.contiguous() for grad in grads], self._prev, index)

    def post_grads(self, metas: Sequence[Meta]) -> None:
        """Post the receive of the gradients of one micro-batch's floating-point outputs (shapes and dtypes).

        Receives are matched in posting order: post them in the order the next stage sends them.
        """
        if self._turns[1] is not None:  # the gradients are taken from the turn as they are
            return
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in metas]
        self._grads.append(([self._next.irecv(buffer) for buffer in buffers], buffers))

    def recv_grads(self, index: int) -> list[Tensor]:
        """Wait for the gradients posted first by :meth:`post_grads` (those of micro-batch ``index``) and return them.

        Raises:
            PipelineFailure: if the next stage failed while this one waited for it.
        """
        if self._turns[1] is not None:
            with self.events.span("recv", index):
                return self._turns[1].take(self._turns[1].gradients)
        works, buffers = self._grads.pop(0)
        with self.events.span("recv", index):
            self._wait(works, self._next.rank)
        return buffers

    def flush(self, through: Optional[int] = None) -> None:
        """Wait until every pending send (of micro-batches ``0`` to ``through`` only, if given) has completed; the
        sends of later micro-batches that have completed are dropped too.

        Raises:
            PipelineFailure: if a neighbour failed while this one waited for it, or a send failed.
        """
        with self.events.span("send"):
            self._drop_completed()
            done = [send for send in self._pending_sends if through is None or send.index <= through]
            self._pending_sends = [send for send in self._pending_sends if through is not None and send.index > through]
            self._wait([work for send in done for work in send.works], None)

    def _post(self, tensors: list[Tensor], peer: "_Peer", index: int) -> None:
        """Drop the sends that have completed, then send ``tensors`` to ``peer`` in order, as micro-batch ``index``'s
        one pending send (kept, with its tensors, until it is known to have completed)."""
        self._drop_completed()
        if not tensors:
            return
        works = [dist.isend(tensor, peer.rank, group=peer.group, tag=peer.tag) for tensor in tensors]
        if not self._polled:  # gloo: is_completed() stays False until wait(), which only one call may make
            works = [self.job.waiter.watch(works, (peer.rank, peer.tag))]
        self._pending_sends.append(_Send(index, works, tensors))

    def _drop_completed(self) -> None:
        """Drop the pending sends whose works have all completed, and with them the last references to their tensors.

        A tensor is dropped only once its send has completed: until then the transport may still read its memory
        (gloo from its own thread; NCCL on its stream, where the caching allocator could hand the block to the next
        tensor of the compute stream). Each completed work is waited for before it is dropped (``wait()`` returns at
        once), so that a failed send raises here, as at a flush.

        Raises:
            PipelineFailure: if one of those sends failed.
        """
        completed, pending = [], []
        for send in self._pending_sends:
            (completed if all(work.is_completed() for work in send.works) else pending).append(send)
        self._pending_sends = pending
        if completed:  # on the per-micro-batch path: no failure scope to enter for nothing
            waiting.wait_in_flight(self.job, [work for send in completed for work in send.works])

    def _wait(self, works: list[dist.Work], peer: Optional[int], in_flight: bool = False) -> None:
        """Wait for ``works`` of transfers with global rank ``peer`` (``None``: both neighbours), interruptibly.

        ``in_flight``: receives whose sender has already issued them (see
        :func:`lightning_gpipe.faults.waiting.wait_in_flight`); on NCCL they are polled like any other, since a sender
        that died does not end an NCCL receive.
        """
        job = self.job
        if self._polled:
            waiting.poll(job, works, job.watchdog.name_of(peer))
        elif in_flight:
            waiting.wait_in_flight(job, works)
        else:
            waiting.wait(job, works, job.watchdog.name_of(peer))

    def _expect(self) -> tuple["_Arrival", Optional["waiting.Watched"]]:
        """Post the receive of the next activation's header; on gloo, have a helper thread of the run wait for it,
        post the payload's receives as soon as it is there and wait for them, while this stage computes
        (:meth:`Waiter.watch <lightning_gpipe.faults.waiting.Waiter.watch>`): the payload then moves before the stage
        asks for it, where it would otherwise move only once the stage had read the header. On NCCL the stage reads
        the header itself once it has arrived (polled; an NCCL communicator is not for two threads at once)."""
        arrival = _Arrival(self._prev, self.device)
        if self._polled:
            return arrival, None
        return arrival, self.job.waiter.watch([arrival], ("recv", self._prev.rank, self._prev.tag))


class _Arrival:
    """One activation on its way from the previous stage: its header's receive, posted when made, then its payload's
    into buffers of the shapes the header gives (see the module docstring for the wire format)."""

    def __init__(self, peer: "_Peer", device: torch.device) -> None:
        self._peer, self._device = peer, device
        self._header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)
        self.header_work = peer.irecv(self._header)
        self.micro_batches = self.index = 0
        self._tuple = False
        self._buffers: list[tuple[Tensor, torch.dtype]] = []
        self.works: list[dist.Work] = []  # the payload's receives, once posted

    def wait(self) -> bool:
        """Wait for the header, post the payload's receives, wait for them (on gloo: a helper thread's call)."""
        self.header_work.wait()
        self.post_payload()
        for work in self.works:
            work.wait()
        return True

    def post_payload(self) -> None:
        """Read the header (it has arrived) and post the payload's receives into buffers of the shapes it gives."""
        header = self._header.tolist()
        self.micro_batches, self.index, is_tuple, n = header[:4]
        self._tuple, pos = bool(is_tuple), 4
        for _ in range(n):
            dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
            shape = header[pos + 2 : pos + 2 + ndim]
            pos += 2 + ndim
            wire_dtype = torch.uint8 if dtype is torch.bool else dtype
            self._buffers.append((torch.empty(shape, dtype=wire_dtype, device=self._device), dtype))
        self.works = [self._peer.irecv(buffer) for buffer, _ in self._buffers]

    def value(self) -> Value:
        """The activation received, a Tensor or a tuple as sent."""
        tensors = [buffer.view(dtype) for buffer, dtype in self._buffers]
        return tuple(tensors) if self._tuple else tensors[0]


class Turn:
    """The link between two neighbouring model chunks of one process (where a V turns): the activations one sends
    and the gradients the other sends back, each taken in the order sent. Each is a copy, as a transfer would
    deliver, so that the receiver can never change what the sender keeps for its backward."""

    def __init__(self) -> None:
        self.activations: deque[tuple[Value, int]] = deque()  # (activation, micro_batches)
        self.gradients: deque[list[Tensor]] = deque()

    @staticmethod
    def take(queue: deque) -> Any:
        """The oldest item of ``queue``.

        Raises:
            RuntimeError: if nothing was sent yet (a plan that receives before it sends; :func:`~lightning_gpipe.
                schedule.check` refuses such plans before step 1).
        """
        if not queue:
            raise RuntimeError("A model chunk took from the turn of its V before the other model chunk sent to it.")
        return queue.popleft()


class _Peer(NamedTuple):
    """A neighbour of a link: its global rank (``None``: none), the messages' tag and process group (``None``: the
    default group)."""

    rank: Optional[int]
    tag: int
    group: Optional[dist.ProcessGroup]

    def irecv(self, buffer: Tensor) -> dist.Work:
        """Post the receive of the peer's next message into ``buffer``."""
        return dist.irecv(buffer, self.rank, group=self.group, tag=self.tag)


class _Send(NamedTuple):
    """One posted send of a link: micro-batch ``index``'s ``tensors`` and their works (on gloo one
    :class:`~lightning_gpipe.faults.waiting.Watched` for all of them)."""

    index: int
    works: list
    tensors: list[Tensor]


def _wire(tensor: Tensor) -> Tensor:
    tensor = tensor.contiguous()
    return tensor.view(torch.uint8) if tensor.dtype is torch.bool else tensor
