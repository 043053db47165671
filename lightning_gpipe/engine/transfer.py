"""Point-to-point transfer of activations and gradients between neighbouring virtual stages.

A link has two planes:

- **data**: the payloads, each micro-batch's activation tensors forward and their gradients backward, on the
  link's process group (gloo on CPU, NCCL on CUDA);
- **control**: what a receiver must know before it can post a payload's receive (the step's number of
  micro-batches M and each micro-batch's shapes, dtypes and memory layouts, its *signature*), on a CPU (gloo) channel
  beside the data: the process group when it is gloo, else a gloo group of its own (``control``), on tags of their
  own. So the host reads it without waiting for a device, and a payload's receive is posted before its sender's device
  has computed it.

**Layouts.** A tensor dense in ``channels_last`` (or ``channels_last_3d``) crosses in that layout, its bytes in memory
order, and its gradient comes back in it, so a ``channels_last`` model's later stages run their layers as they were
profiled (a contiguous copy made AmoebaNet-D's second stage 1.4x slower than its profile); any other tensor crosses as a
contiguous copy.

**One step message per step.** Before its first forward of a step, a stage sends its next stage one control message:
M and every micro-batch's signature (:func:`step_message`), as soon as its host knows them: the first stage from the
scatter of the backbone input, every other stage from its own step message and its model chunk's prediction of the
output signature from the input's (:class:`~lightning_gpipe.engine.model_chunk.ModelChunk`, which learns it from the
steps before and checks it). A micro-batch whose signature its sender cannot predict yet (a new input shape, a
first step) is *headed*: its signature goes on the control channel right before its payload (:data:`HEADER_SLOTS`).
So shapes may change from step to step and between micro-batches (variable-length text, an uneven last
micro-batch) with no flag, and a steady state sends one control message per step and link, nothing per
micro-batch. Gradients need no signature: their receiver sent the activation and knows its shapes. A link without a
step message (a skip connection's, ``stepped=False``) heads every activation.

Latency matters as much as bandwidth: gloo moves a payload only once its receive is posted, and a blocked receive
costs a wake-up. So receives are posted ahead: the next micro-batch's payload while this one computes, a gradient
as soon as the schedule expects it (``expect``). Sends are asynchronous and overlap compute; a send keeps its
tensors alive until it has completed, and the link drops completed sends whenever it posts another and at a flush.
On gloo, whose works cannot be polled, a helper thread of the run waits for each send and receive as soon as it
is posted (:meth:`Waiter.watch <lightning_gpipe.faults.waiting.Waiter.watch>`), and the stage waits through the
run's interruptible waits (:func:`~lightning_gpipe.faults.waiting.wait_watched`): signals are handled and a failed
or stalled neighbour named, and a payload that arrived while the stage computed is taken without a thread
hand-off. On CUDA (NCCL) receives are posted on a stream of their own, so they start at once rather than
after the compute queued before them, and taking a received tensor makes the compute stream wait for its transfer
(``Work.wait``), never the host; the host waits only on the control plane, for its neighbour's host. A flush then
waits for nothing: it drops the sends that have completed (the rest stay alive until they have).

Where two neighbouring model chunks are on one process (where ZB-V's V turns, :func:`~lightning_gpipe.engine.
actions.virtual_stage`), their link is a :class:`Turn`: what one model chunk sends the other takes, in order,
without a transfer.

Every send and every wait is recorded as a ``send`` or ``recv`` span of the link's
:class:`~lightning_gpipe.engine.events.Recorder` (shared with its model chunk), for the pipeline callbacks.
"""

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.microbatch import Value
from lightning_gpipe.faults import waiting

if TYPE_CHECKING:
    import numpy as np

    from lightning_gpipe.faults import Job

Meta = tuple[torch.Size, torch.dtype]
"""Shape and dtype of a tensor whose gradient will arrive."""

Layout = int
"""A tensor's memory layout on the wire: an index into :data:`LAYOUTS`."""

Signature = tuple[bool, tuple[tuple[torch.Size, torch.dtype, Layout], ...]]
"""What a receiver must know of one activation to receive it: whether it is a tuple, and each tensor's shape, dtype
and :func:`layout` (non-tensor items of a tuple are not sent)."""

LAYOUTS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
"""The memory formats an activation keeps across a stage boundary: a ``channels_last`` model's next stage gets its
input ``channels_last`` (as its layers were profiled), not a contiguous copy."""

_WIRE_ORDER = {1: (0, 2, 3, 1), 2: (0, 2, 3, 4, 1)}
"""The dimension order in which a tensor of each non-contiguous :data:`LAYOUTS` entry is dense."""

HEADER_SLOTS = 128
"""int64 slots of a headed micro-batch's signature: room for 20 four-dimensional tensors per activation."""

STEP_SLOTS = 1024
"""int64 slots of a step message (M, the distinct signatures, and each micro-batch's; headed past that)."""

CONTROL_TAG = 1 << 20
"""Added to a link's tag for its control messages, where they share a process group with its payloads."""

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)  # fmt: skip


def signature(value: Value) -> Signature:
    """The signature of the activation ``value`` (a Tensor or a tuple).

    Raises:
        ValueError: for a dtype that cannot be sent between stages.
    """
    tensors = microbatch.tensors(value)
    for tensor in tensors:
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"Cannot send a {tensor.dtype} tensor between stages; use one of {_DTYPES}.")
    return not isinstance(value, Tensor), tuple((tensor.shape, tensor.dtype, layout(tensor)) for tensor in tensors)


def layout(tensor: Tensor) -> Layout:
    """The index in :data:`LAYOUTS` of the memory format ``tensor`` is dense in: 0 where it is contiguous or dense in
    none of them (it is sent as a contiguous copy)."""
    if tensor.is_contiguous():
        return 0
    for code in (1, 2):
        if tensor.dim() == len(_WIRE_ORDER[code]) and tensor.is_contiguous(memory_format=LAYOUTS[code]):
            return code
    return 0


def _encode(sig: Signature) -> list[int]:
    is_tuple, metas = sig
    words = [int(is_tuple), len(metas)]
    for shape, dtype, code in metas:
        words += [_DTYPES.index(dtype) + len(_DTYPES) * code, len(shape), *shape]
    return words


def _decode(words: "Sequence[int] | np.ndarray", pos: int) -> tuple[Signature, int]:
    """The signature encoded at ``words[pos:]`` and the position after it."""
    is_tuple, count, pos, metas = bool(words[pos]), int(words[pos + 1]), pos + 2, []
    for _ in range(count):
        code, dtype = divmod(int(words[pos]), len(_DTYPES))
        ndim = int(words[pos + 1])
        metas.append((torch.Size(int(n) for n in words[pos + 2 : pos + 2 + ndim]), _DTYPES[dtype], code))
        pos += 2 + ndim
    return (is_tuple, tuple(metas)), pos


def step_message(micro_batches: int, signatures: Sequence[Signature | None]) -> list[int]:
    """The words of a step message: ``[M, S, S distinct signatures, M indices into them (-1: headed)]``, at most
    :data:`STEP_SLOTS`; ``[M, -1]`` (every micro-batch headed) when they do not fit."""
    distinct = list(dict.fromkeys(sig for sig in signatures if sig is not None))
    words = [micro_batches, len(distinct)] + [w for sig in distinct for w in _encode(sig)]
    words += [distinct.index(sig) if sig is not None else -1 for sig in signatures]
    return words if len(words) <= STEP_SLOTS else [micro_batches, -1]


def read_step_message(message: Tensor) -> tuple[int, list[Signature | None]]:
    """M and each micro-batch's signature (``None``: headed) of a received :func:`step_message` in its
    :data:`STEP_SLOTS` int64 slots (one host read)."""
    words = message.numpy()
    micro_batches, count = int(words[0]), int(words[1])
    if count < 0:
        return micro_batches, [None] * micro_batches
    distinct, pos = [], 2
    for _ in range(count):
        sig, pos = _decode(words, pos)
        distinct.append(sig)
    return micro_batches, [distinct[int(i)] if i >= 0 else None for i in words[pos : pos + micro_batches]]


class _Peer(NamedTuple):
    """A neighbour of a link: its global rank (``None``: none), the payloads' tag and process group (``None``: the
    default group), the control messages' group and tag, and the run's job (whose failure board names the cause when
    a transfer cannot even be posted)."""

    rank: int | None
    tag: int
    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    control_tag: int
    job: "Job"

    def irecv(self, buffer: Tensor) -> dist.Work:
        """Post the receive of the peer's next payload into ``buffer``."""
        return self._posted(dist.irecv, buffer, self.group, self.tag)

    def isend(self, tensor: Tensor) -> dist.Work:
        """Send ``tensor`` to the peer as its next payload."""
        return self._posted(dist.isend, tensor, self.group, self.tag)

    def irecv_control(self, buffer: Tensor) -> dist.Work:
        """Post the receive of the peer's next control message into the CPU tensor ``buffer``."""
        return self._posted(dist.irecv, buffer, self.control, self.control_tag)

    def isend_control(self, tensor: Tensor) -> dist.Work:
        """Send the CPU tensor ``tensor`` to the peer as its next control message."""
        return self._posted(dist.isend, tensor, self.control, self.control_tag)

    def _posted(self, post: Any, tensor: Tensor, group: dist.ProcessGroup | None, tag: int) -> dist.Work:
        """The work of ``post`` (``dist.irecv`` or ``dist.isend``) of ``tensor`` with the peer.

        Raises:
            PipelineFailure: if the transfer cannot be posted: gloo refuses once the connection to the peer has
                closed (the peer's process ended), naming the cause as a failed wait does.
        """
        try:
            # torch returns None only to a process outside the group: a link's process is in its groups
            return cast(dist.Work, post(tensor, self.rank, group=group, tag=tag))
        except RuntimeError as error:
            raise self.job.board.failure(error, self.job.watchdog.last_positions) from error


class _Send(NamedTuple):
    """One posted send of a link: micro-batch ``index``'s ``tensors`` (``None``: a control message) and their works
    (on gloo one :class:`~lightning_gpipe.faults.waiting.Watched` for all of them)."""

    index: int | None  # type: ignore[assignment]  # a field named as tuple's method `index`, which it hides
    works: list
    tensors: list[Tensor]


class _Arrival:
    """One activation on its way from the previous stage: its payload's receives into buffers of its signature,
    posted at once when the step message gave it, or once its header has arrived when it is headed."""

    def __init__(self, link: "Link", sig: Signature | None) -> None:
        self._link, self.sig = link, sig
        self._header: tuple[Tensor, list] | None = None  # the header and its receive, as Link._receiving gives it
        self.works: list = []  # as Link._receiving gives them
        self.buffers: list[Tensor] = []
        if sig is None:
            header = torch.empty(HEADER_SLOTS, dtype=torch.int64)
            self._header = (header, link._receiving([link._prev.irecv_control(header)], link._prev, control=True))
        else:
            self._post()

    def _post(self) -> None:
        link = self._link
        assert self.sig is not None  # given, or decoded from the header
        with link._device.receiving():
            self.buffers = [link._device.empty(shape, dtype, code) for shape, dtype, code in self.sig[1]]
        wires = [_wire(buffer, code) for buffer, (_, _, code) in zip(self.buffers, self.sig[1])]
        self.works = link._receiving([link._prev.irecv(wire) for wire in wires], link._prev)

    @property
    def posted(self) -> bool:
        """Whether its payload's receives are posted (payloads match receives in posting order, so a later
        activation's may be posted only then)."""
        return self._header is None

    def take(self) -> Value:
        """Wait for the activation (its header first, if headed) and return it, as sent."""
        link = self._link
        if self._header is not None:
            header, works = self._header
            link._take(works, [], link._prev.rank)
            self.sig, _ = _decode(header.numpy(), 0)  # arrived: a host read of a CPU tensor
            self._header = None
            self._post()
        link._take(self.works, self.buffers, link._prev.rank)
        tensors = self.buffers
        assert self.sig is not None  # given, or decoded from the header
        return tuple(tensors) if self.sig[0] else tensors[0]


class _Device:
    """Where a link's tensors live: on CUDA, received tensors are allocated and received on a stream of their own,
    and a taken one is handed to the compute stream (it waits for the transfer, the host does not)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def receiving(self) -> Any:
        """The context in which receive buffers are allocated and receives posted."""
        return torch.cuda.stream(self.stream) if self.stream is not None else _NO_CONTEXT

    def empty(self, shape: torch.Size, dtype: torch.dtype, code: Layout = 0) -> Tensor:
        """A receive buffer, in the memory layout ``LAYOUTS[code]``."""
        return torch.empty(shape, dtype=dtype, device=self.device, memory_format=LAYOUTS[code])

    def hand_over(self, buffers: list[Tensor]) -> None:
        """Let the compute stream use ``buffers`` (received on the receive stream), as the caching allocator needs."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            for buffer in buffers:
                buffer.record_stream(current)


class _NoContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: Any) -> None:
        return None


_NO_CONTEXT = _NoContext()


class Link:
    """The connections of one virtual stage to the one before and the one after it.

    Args:
        prev_rank: global rank of the previous virtual stage, ``None`` on the first.
        next_rank: global rank of the next virtual stage, ``None`` on the last.
        device: the stage's device; received tensors are put there.
        events: where sends and waits are recorded as spans; a new (disabled) recorder by default.
        tag: the point-to-point tag of every payload, so that two links between the same pair of ranks (a
            stage's neighbour link and a skip connection's, :mod:`lightning_gpipe.engine.skip.links`, or two model
            chunks' links under virtual stages) do not mix; 0 by default. A pair ``(previous, next)`` gives the
            messages with each neighbour their own tag (under virtual stages, the two neighbours may be one rank).
            Control messages use the tag plus :data:`CONTROL_TAG`. NCCL ignores tags: there two such links need
            process groups of their own (``groups``).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the link's waits are (failure board,
            stall watchdog, names of the neighbours).
        groups: the process groups of the payloads with the previous and the next virtual stage
            (:mod:`lightning_gpipe.engine.channels`); ``None`` (default): the default group.
        turns: the :class:`Turn` with the previous and the next virtual stage where it is a model chunk of the same
            process (``None``, default: a transfer).
        control: the CPU (gloo) process group of the control messages; ``None`` (default): the payloads' group,
            which must then be gloo (a CPU job).
        stepped: whether the link sends one step message per step (the neighbour links); ``False`` (a skip
            connection's link): every activation is headed.
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        events: Recorder | None = None,
        tag: int | tuple[int, int] = 0,
        *,
        job: "Job",
        groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
        turns: tuple[Optional["Turn"], Optional["Turn"]] = (None, None),
        control: dist.ProcessGroup | None = None,
        stepped: bool = True,
    ) -> None:
        self.device, self.job, self.stepped = device, job, stepped
        self._turns = turns
        self.events = events if events is not None else Recorder()
        prev_tag, next_tag = tag if isinstance(tag, tuple) else (tag, tag)
        self._prev = _peer(prev_rank, prev_tag, groups[0], control, job)
        self._next = _peer(next_rank, next_tag, groups[1], control, job)
        self._device = _Device(device)
        self._polled = waiting.polls(device)  # NCCL: the compute stream waits, not the host; gloo: a helper thread
        self._pending_sends: list[_Send] = []  # posted, not known to have completed: their tensors kept alive
        self._headed: list[bool] = []  # this step's micro-batches whose signature goes before their payload
        self._announced: list[Signature | None] = []  # this step's signatures as the step message gave them
        self._sent_codes: dict[int, list[Layout]] = {}  # per micro-batch, the layouts its floats went in
        self._expected: deque[Signature | None] = deque()  # the signatures of this step's activations to come
        self._arrivals: deque[_Arrival] = deque()  # the next activations, their receives posted
        self._grads: list[tuple[list[dist.Work], list[Tensor]]] = []

    # the sending side: activations to the next virtual stage, gradients to the previous one

    def send_step(self, micro_batches: int, signatures: Sequence[Signature | None]) -> None:
        """Send the next virtual stage this step's step message: M and each micro-batch's activation signature
        (``None``: headed, not known before it is computed). Before the step's first activation.

        Raises:
            PipelineFailure: if an earlier send of this link failed.
        """
        self._headed, self._announced = [sig is None for sig in signatures], list(signatures)
        if self._turns[1] is not None:
            self._turns[1].steps.append((micro_batches, list(signatures)))
        elif self._next.rank is not None:
            with self.events.span("send"):
                words = step_message(micro_batches, signatures)
                self._headed = [True] * micro_batches if words[1] < 0 else self._headed
                message = torch.tensor(words + [0] * (STEP_SLOTS - len(words)), dtype=torch.int64)
                self._post_control(message, self._next)

    def send_activation(self, value: Value, index: int) -> None:
        """Send micro-batch ``index``'s output (a Tensor or tuple of tensors) to the next virtual stage,
        asynchronously: after its signature, on the control channel, when it is headed.

        Raises:
            ValueError: if a dtype cannot be sent, or a headed signature does not fit in :data:`HEADER_SLOTS`.
            PipelineFailure: if an earlier send of this link failed.
        """
        with self.events.span("send", index):
            if self._turns[1] is not None:
                self._turns[1].activations.append(microbatch.leaves(value, False, self.device))
                return
            tensors = [tensor.detach() for tensor in microbatch.tensors(value)]
            if not self.stepped or index >= len(self._headed) or self._headed[index]:
                self._post_control(self._header(value), self._next)
                codes = [layout(tensor) for tensor in tensors]
            else:  # in the layouts the step message announced, in which the receiver has allocated
                codes = [code for _, _, code in cast(Signature, self._announced[index])[1]]
            wires = [_wire(tensor, code) for tensor, code in zip(tensors, codes)]
            self._sent_codes[index] = [code for tensor, code in zip(tensors, codes) if tensor.is_floating_point()]
            self._post([self._next.isend(wire) for wire in wires], wires, index, self._next)

    @staticmethod
    def _header(value: Value) -> Tensor:
        words = _encode(signature(value))
        if len(words) > HEADER_SLOTS:
            raise ValueError(
                f"An activation of {len(words)} header words is too large to describe in {HEADER_SLOTS} slots; pass"
                " fewer tensors between layers (e.g. stack them)."
            )
        return torch.tensor(words + [0] * (HEADER_SLOTS - len(words)), dtype=torch.int64)

    def send_grads(self, grads: list[Tensor], index: int, inputs: Sequence[Tensor] | None = None) -> None:
        """Send the gradients of micro-batch ``index``'s floating-point inputs back to the previous virtual stage,
        asynchronously, each in the memory layout of its input as it arrived (``inputs``, one per gradient; default:
        contiguous), in which the previous stage receives it (:meth:`post_grads`).

        Raises:
            PipelineFailure: if an earlier send of this link failed.
        """
        with self.events.span("send", index):
            if self._turns[0] is not None:
                self._turns[0].gradients.append([microbatch.leaves(grad, False, self.device) for grad in grads])
            else:
                codes = [layout(x) for x in inputs] if inputs is not None else [0] * len(grads)
                tensors = [_wire(grad, code) for grad, code in zip(grads, codes)]
                self._post([self._prev.isend(tensor) for tensor in tensors], tensors, index, self._prev)

    # the receiving side: activations from the previous virtual stage, gradients from the next one

    def receive_step(self) -> tuple[int, list[Signature | None]]:
        """This step's M and activation signatures from the previous virtual stage's step message (waiting for it),
        and post the receive of the first activation.

        Raises:
            PipelineFailure: if the previous stage failed while this one waited for it.
        """
        if self._turns[0] is not None:
            return Turn.take(self._turns[0].steps)
        with self.events.span("recv"):
            message = torch.empty(STEP_SLOTS, dtype=torch.int64)
            self._wait([self._prev.irecv_control(message)], self._prev.rank)
            micro_batches, signatures = read_step_message(message)
        self._expected = deque(signatures)
        self._arrivals = deque([cast(_Arrival, self._expect())] if self._expected else [])
        return micro_batches, signatures

    def recv_activation(self, ahead: bool = False) -> Value:
        """Receive the next micro-batch's activation from the previous virtual stage (Tensor or tuple, as sent), and
        post the receive of the one after it, or with ``ahead`` of every one left in the step (gloo moves a payload
        only once its receive is posted: a receive posted after the send costs a round trip).

        Raises:
            PipelineFailure: if the previous stage failed while this one waited for it.
        """
        if self._turns[0] is not None:
            with self.events.span("recv"):
                return self._turns[0].take(self._turns[0].activations)
        start = time.perf_counter()
        if not self.stepped:
            self._expected.append(None)
        arrival = self._arrivals.popleft() if self._arrivals else self._expect()
        assert arrival is not None  # an activation of the step (or, unstepped, the one expected above)
        # posted before this one is waited for, in micro-batch order: not past a headed payload not yet posted
        while self._expected and (ahead or not self._arrivals) and (self._arrivals or [arrival])[-1].posted:
            self._arrivals.append(cast(_Arrival, self._expect()))  # one is expected
        value = arrival.take()
        if self.events.enabled:
            self.events.add("recv", None, start, time.perf_counter())
        return value

    def _expect(self) -> _Arrival | None:
        return _Arrival(self, self._expected.popleft()) if self._expected else None

    def post_grads(self, metas: Sequence[Meta], index: int | None = None) -> None:
        """Post the receive of the gradients of one micro-batch's floating-point outputs (shapes and dtypes): those
        of micro-batch ``index``'s activation, sent by this link, in the memory layouts it went in (the next stage
        sends them so, :meth:`send_grads`); without ``index``, contiguous.

        Receives are matched in posting order: post them in the order the next stage sends them.
        """
        if self._turns[1] is not None:  # the gradients are taken from the turn as they are
            return
        zeros = [0] * len(metas)
        codes = zeros if index is None else self._sent_codes.get(index, zeros)
        with self._device.receiving():
            buffers = [self._device.empty(shape, dtype, code) for (shape, dtype), code in zip(metas, codes)]
        wires = [_wire(buffer, code) for buffer, code in zip(buffers, codes)]
        self._grads.append((self._receiving([self._next.irecv(wire) for wire in wires], self._next), buffers))

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
            self._take(works, buffers, self._next.rank)
        return buffers

    # completion

    def flush(self, through: int | None = None) -> None:
        """Wait until every pending send (of micro-batches ``0`` to ``through`` only, if given) has completed; the
        sends of later micro-batches that have completed are dropped too. On NCCL, whose transfers the compute
        stream is ordered with, the host waits for none: the sends that have completed are dropped, the others stay
        alive until they have.

        Raises:
            PipelineFailure: if a neighbour failed while this one waited for it, or a send failed.
        """
        with self.events.span("send"):
            self._drop_completed()
            done = [send for send in self._pending_sends if _through(send, through) and self._waits_for(send)]
            self._pending_sends = [send for send in self._pending_sends if send not in done]
            self._wait([work for send in done for work in send.works], None)

    def _waits_for(self, send: _Send) -> bool:
        """Whether a flush waits for ``send`` on the host: every send on gloo; on NCCL only the control messages
        (gloo, host to host), never a payload, whose transfer the compute stream is ordered with."""
        return not self._polled or send.index is None

    def _post_control(self, message: Tensor, peer: _Peer) -> None:
        """Send the CPU tensor ``message`` to ``peer`` on the control channel, pending until it has completed."""
        work = self.job.waiter.watch([peer.isend_control(message)], (peer.rank, peer.control_tag))
        self._drop_completed()
        self._pending_sends.append(_Send(None, [work], [message]))

    def _post(self, works: list, tensors: list[Tensor], index: int, peer: _Peer) -> None:
        """Drop the sends that have completed, then keep ``works`` (payload sends of ``tensors`` to ``peer``) as one
        pending send until it has."""
        self._drop_completed()
        if not works:
            return
        if not self._polled:  # gloo: is_completed() stays False until wait(), which only one call may make
            works = [self.job.waiter.watch(works, (peer.rank, peer.tag))]
        self._pending_sends.append(_Send(index, works, tensors))

    def _drop_completed(self) -> None:
        """Drop the pending sends whose works have all completed, and with them the last references to their
        tensors. A tensor is dropped only once its send has completed: until then the transport may still read
        its memory (gloo from its own thread; NCCL on its stream, where the caching allocator could hand the
        block to the next tensor of the compute stream). Each completed work is waited for before it is dropped
        (``wait()`` returns at once), so that a failed send raises here, as at a flush.

        Raises:
            PipelineFailure: if one of those sends failed.
        """
        completed: list[_Send] = []
        pending: list[_Send] = []
        for send in self._pending_sends:
            (completed if all(work.is_completed() for work in send.works) else pending).append(send)
        self._pending_sends = pending
        if completed:  # on the per-micro-batch path: no failure scope to enter for nothing
            waiting.wait_completed(self.job, [work for send in completed for work in send.works])

    def _receiving(self, works: list[dist.Work], peer: _Peer, control: bool = False) -> list:
        """``works``, receives just posted from ``peer`` (of a control message: ``control``), as :meth:`_take` waits
        for them: on gloo one :class:`~lightning_gpipe.faults.waiting.Watched` (a helper thread of their stream, the
        peer and tag, waits for them from now on, in the order posted, so that a transfer that arrived while the stage
        computed costs no hand-off when taken); on NCCL
        as they are."""
        if self._polled or not works:
            return works
        return [self.job.waiter.watch(works, ("recv", peer.rank, peer.control_tag if control else peer.tag))]

    def _take(self, works: list, buffers: list[Tensor], peer: int | None) -> None:
        """Wait for receives from global rank ``peer`` (as :meth:`_receiving` returned them) into ``buffers``: on
        NCCL the compute stream waits for them (``Work.wait``), the host does not; on gloo the host waits,
        interruptibly (:func:`~lightning_gpipe.faults.waiting.wait_watched`)."""
        if self._polled:
            with self.job.board.as_pipeline_failure(detail=self.job.watchdog.last_positions):
                for work in works:
                    work.wait()  # NCCL: orders the compute stream after the transfer; the host goes on
            self._device.hand_over(buffers)
        elif works:
            waiting.wait_watched(self.job, works[0], self.job.watchdog.name_of(peer))

    def _wait(self, works: list[dist.Work], peer: int | None) -> None:
        """Wait on the host for ``works`` of control messages or gloo transfers with global rank ``peer``
        (``None``: both neighbours), interruptibly (:func:`~lightning_gpipe.faults.waiting.wait`)."""
        waiting.wait(self.job, works, self.job.watchdog.name_of(peer))


def _peer(rank: int | None, tag: int, group: dist.ProcessGroup | None, control: dist.ProcessGroup | None, job: "Job"):
    """A neighbour, its control messages on ``control`` (``None``: ``group``) on a tag of their own."""
    return _Peer(rank, tag, group, control if control is not None else group, tag + CONTROL_TAG, job)


def _through(send: _Send, through: int | None) -> bool:
    return through is None or send.index is None or send.index <= through


class Turn:
    """The link between two neighbouring model chunks of one process (where a V turns): the step messages and
    activations one sends and the gradients the other sends back, each taken in the order sent. Each tensor is a
    copy, as a transfer would deliver, so that the receiver can never change what the sender keeps for its
    backward."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, list[Signature | None]]] = deque()
        self.activations: deque[Value] = deque()
        self.gradients: deque[list[Tensor]] = deque()

    @staticmethod
    def take(queue: deque) -> Any:
        """The oldest item of ``queue``.

        Raises:
            RuntimeError: if nothing was sent yet (a plan that receives before it sends; :func:`~lightning_gpipe.
                engine.schedule.check` refuses such plans before step 1).
        """
        if not queue:
            raise RuntimeError("A model chunk took from the turn of its V before the other model chunk sent to it.")
        return queue.popleft()


def _wire(tensor: Tensor, code: Layout = 0) -> Tensor:
    """``tensor`` as its bytes go on the wire: dense in the memory layout ``LAYOUTS[code]`` (a copy where it is not),
    viewed in the order of its memory so that the view is contiguous (the same memory: a receive buffer's view
    fills the buffer); a bool tensor as bytes."""
    tensor = tensor.contiguous(memory_format=LAYOUTS[code])
    if code:
        tensor = tensor.permute(_WIRE_ORDER[code])
    return tensor.view(torch.uint8) if tensor.dtype is torch.bool else tensor
