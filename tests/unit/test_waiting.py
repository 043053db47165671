"""The two waits of :mod:`lightning_gpipe.faults.waiting`, on fake works that behave like NCCL's and like gloo's, in
this
process (no GPU, no process group): an NCCL-like wait polls until its works complete, handles signals, reads the
failure board and the stall limit meanwhile, and calls ``wait()`` only on works that have completed, so that a host
read of a received header or size (``transfer.Link``, ``collectives``) comes after the bytes.

Synchronisation is by events and by works that complete after a number of looks, never by sleeping.
"""

import itertools
import json
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_gpipe import PipelineFailure
from lightning_gpipe.engine.transfer import CONTROL_TAG, Link, Turn, signature
from lightning_gpipe.faults import waiting
from lightning_gpipe.faults.job import Job


class NcclLikeWork:
    """Stands for a ProcessGroupNCCL work: ``wait()`` returns at once (NCCL's only makes the current CUDA stream wait
    for the transfer) and raises the work's error, if any; ``is_completed()`` never blocks and turns ``True`` after
    ``polls`` looks, once :meth:`complete` is called (from another thread), or never.

    Args:
        polls: looks after which the work completes by itself; ``None``: only :meth:`complete` completes it.
        deliver: puts the transferred bytes in place when the work completes.
        error: raised by ``wait()`` (NCCL reports an asynchronous error as completion, then ``wait()`` raises it).
    """

    def __init__(
        self, polls: int | None = None, deliver: Callable[[], object] = lambda: None, error: Exception = None
    ) -> None:
        self.left, self.deliver, self.error = polls, deliver, error
        self.done = threading.Event()
        self.looked = threading.Event()
        self.waits = 0
        self.early_waits = 0  # wait() calls before completion: on NCCL, a host read after them could hang

    def complete(self) -> None:
        self.deliver()
        self.done.set()

    def is_completed(self) -> bool:
        self.looked.set()
        if self.left is not None and not self.done.is_set():
            self.left -= 1
            if self.left <= 0:
                self.complete()
        return self.done.is_set()

    def wait(self) -> bool:
        self.waits += 1
        self.early_waits += not self.done.is_set()
        if self.error is not None:
            raise self.error
        return True


class GlooLikeWork:
    """Stands for a gloo point-to-point work: ``wait()`` blocks until the transfer has completed (here: delivers at
    once, or waits for :attr:`done` when ``blocks``); it cannot be polled."""

    def __init__(self, deliver: Callable[[], object] = lambda: None, blocks: bool = False) -> None:
        self.deliver = deliver
        self.done, self.entered = threading.Event(), threading.Event()
        if not blocks:
            self.done.set()

    def wait(self) -> bool:
        self.entered.set()
        self.done.wait()
        self.deliver()
        return True

    def is_completed(self) -> bool:
        raise AssertionError("a gloo work was polled: its is_completed() stays False until wait() returns")


class FakeTransport:
    """Stands for ``dist.isend``/``dist.irecv`` between two links in this process: a receive gets the oldest message
    sent on its tag, through a work of ``kind`` that puts it in the receive buffer when it completes; a control
    message (a tag from :data:`~lightning_gpipe.engine.transfer.CONTROL_TAG` on) travels as on gloo, whatever
    ``kind`` the payloads' works are."""

    def __init__(self, kind: Callable[..., object]) -> None:
        self.kind = kind
        self.messages: dict[int, list[torch.Tensor]] = {}
        self.works: list = []
        self.receives: list = []  # the payloads' receive works
        self.control: list = []

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
        self.messages.setdefault(tag, []).append(tensor.clone())
        return self._work(lambda: None, tag)

    def irecv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0):
        message = self.messages[tag].pop(0)
        # as gloo: contiguous buffers of one dtype, the bytes copied in memory order whatever the shapes say
        assert tensor.is_contiguous() and message.is_contiguous() and tensor.dtype == message.dtype
        assert tensor.numel() == message.numel()
        work = self._work(lambda: tensor.view(-1).copy_(message.view(-1)), tag)
        if tag < CONTROL_TAG:
            self.receives.append(work)
        return work

    def _work(self, deliver: Callable[[], object], tag: int):
        if tag >= CONTROL_TAG:
            self.control.append(GlooLikeWork(deliver))
            return self.control[-1]
        work = self.kind(deliver)
        self.works.append(work)
        return work


def _nccl_like(polls: int) -> Callable[..., NcclLikeWork]:
    return lambda deliver: NcclLikeWork(polls=polls, deliver=deliver)


class StreamOrderedWork(NcclLikeWork):
    """An :class:`NcclLikeWork` whose ``wait()`` stands for the compute stream waiting for the transfer: what the
    stream runs after it sees the bytes (here: they are delivered by the wait), whatever the host knows."""

    def wait(self) -> bool:
        if not self.done.is_set():
            self.complete()
        return super().wait()


@pytest.fixture
def job():
    """A job without a store (nothing published or read), as stage 0."""
    with Job() as job:
        yield job


@pytest.fixture
def board(monkeypatch):
    """A job on an in-process store, as stage 0 of a 2-stage pipeline (as in tests/unit/test_failures.py), whose
    failure board is looked at every 5 ms while a wait lasts; no stall limit unless a test sets one."""
    monkeypatch.setattr(waiting, "TICK", 0.005)
    with Job(dist.HashStore(), 0, {0: "stage 0", 1: "stage 1"}, processes=1) as job:
        yield job


@pytest.mark.parametrize(
    "config, device, expected",
    [
        ("cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cuda", True),
        ("cpu:gloo,cuda:nccl", "cpu", False),
        ("cpu:gloo,cuda:gloo", "cuda", False),
        ("cpu:gloo,cuda:gloo", "cpu", False),
    ],
)
def test_the_backend_of_the_tensors_device_chooses_the_wait(monkeypatch, config, device, expected):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    assert waiting.polls(torch.device(device)) is expected


def test_cpu_tensors_are_waited_for_by_the_helper_thread_without_asking_the_process_group(monkeypatch):
    def no_group(group=None):
        raise AssertionError("the process group was asked about CPU tensors")

    monkeypatch.setattr(dist, "get_backend_config", no_group)
    assert waiting.polls(torch.device("cpu")) is False


def test_an_nccl_like_wait_returns_when_its_works_complete_and_waits_for_them_only_then(job):
    first, second = NcclLikeWork(), NcclLikeWork(polls=3)
    threading.Thread(target=lambda: first.looked.wait() and first.complete(), daemon=True).start()
    waiting.poll(job, [first, second], "stage 1")
    assert first.done.is_set() and second.done.is_set()
    assert (first.waits, second.waits) == (1, 1) and first.early_waits + second.early_waits == 0


def test_an_nccl_like_wait_raises_the_error_its_work_reports(job):
    work = NcclLikeWork(polls=2, error=RuntimeError("NCCL communicator was aborted"))
    with pytest.raises(PipelineFailure, match=r"another stage stopped responding \(NCCL communicator was aborted\)"):
        waiting.poll(job, [work], "stage 1")


def test_an_nccl_like_wait_stops_when_another_stage_publishes_a_failure(board):
    work = NcclLikeWork()  # never completes
    publish = threading.Thread(
        target=lambda: work.looked.wait() and board.board.publish("stage 1 failed with ValueError: boom"), daemon=True
    )
    publish.start()
    with pytest.raises(PipelineFailure, match="^stage 0 stopped because stage 1 failed with ValueError: boom$"):
        waiting.poll(board, [work], "stage 1")
    publish.join()
    assert work.waits == 0  # an NCCL work that has not completed is never waited for


def test_an_nccl_like_wait_counts_as_a_wait_for_the_stall_watchdog(board, monkeypatch):
    board.watchdog.limit = 0.0
    looks = itertools.count()  # the wait's clock moves 10 ms a look, however slow the machine: it waits 0 s, rounded
    monkeypatch.setattr(waiting, "time", SimpleNamespace(monotonic=lambda: 0.01 * next(looks), sleep=time.sleep))
    position = dict(step="step 17", phase="forward", micro_batch=3, since=time.time() - 300, waits_for=None)
    board.board.store.set(board.board.key("where/1"), json.dumps({**position, "unbounded": False}))
    with pytest.raises(PipelineFailure) as raised:
        waiting.poll(board, [NcclLikeWork()], "stage 1")
    message = str(raised.value)
    assert message.startswith("stage 0 stopped because stage 1 has been in the forward of micro-batch 3 at step 17")
    assert "stage 0 gave up after waiting 0 s for stage 1" in message
    assert board.board.store.get(board.board.key("stalled")) == b"1"


def test_a_signal_handler_runs_while_an_nccl_like_wait_waits(job):
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    work, main = NcclLikeWork(), threading.main_thread().ident
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Thread(target=lambda: work.looked.wait() and signal.pthread_kill(main, signal.SIGUSR1)).start()
        with pytest.raises(Interrupted):
            waiting.poll(job, [work], "stage 1")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert work.waits == 0


def test_a_gloo_like_wait_goes_through_the_helper_thread(job):
    work = GlooLikeWork(blocks=True)
    threading.Thread(target=lambda: work.entered.wait() and work.done.set(), daemon=True).start()
    waiting.wait(job, [work], "stage 1")  # never polled: GlooLikeWork.is_completed would raise
    assert work.done.is_set()


def _send_and_receive(monkeypatch, transport: FakeTransport, polled: bool, predicted: bool):
    """Two steps of two micro-batches sent by one link and received by another through ``transport``, the links'
    payload waits polled or not, each step's signatures in its step message (``predicted``) or headed; returns what
    was sent and what was received: per step, M and the activations."""
    monkeypatch.setattr(waiting, "polls", lambda device, group=None: polled)
    monkeypatch.setattr(dist, "isend", transport.isend)
    monkeypatch.setattr(dist, "irecv", transport.irecv)
    job = Job()
    sender, receiver = Link(None, 1, torch.device("cpu"), job=job), Link(0, None, torch.device("cpu"), job=job)
    sent, received = [], []
    for rows in (3, 5):  # the second step's shapes differ from the first's
        values = [(torch.randn(rows, 4), torch.rand(rows) > 0.5), (torch.randn(rows, 4), torch.rand(rows) > 0.5)]
        sender.send_step(2, [signature(value) if predicted else None for value in values])
        for index, value in enumerate(values):
            sender.send_activation(value, index)
        sender.flush()
        count, _ = receiver.receive_step()
        sent.append(values)
        received.append((count, [receiver.recv_activation() for _ in range(count)]))
    return sent, received


@pytest.mark.parametrize("predicted", [True, False])
def test_an_nccl_like_link_takes_payloads_without_waiting_for_them_on_the_host(monkeypatch, predicted):
    transport = FakeTransport(lambda deliver: StreamOrderedWork(deliver=deliver))
    sent, received = _send_and_receive(monkeypatch, transport, polled=True, predicted=predicted)
    for values, (count, got) in zip(sent, received):
        assert count == 2
        for value, activation in zip(values, got):
            assert isinstance(activation, tuple) and activation[1].dtype is torch.bool
            for a, b in zip(value, activation):
                torch.testing.assert_close(b, a, rtol=0, atol=0)
    # per step: a step message, and per headed micro-batch its header, on the control channel (gloo, host-read)
    assert len(transport.control) == 2 * (2 + (0 if predicted else 4))
    assert all(work.done.is_set() for work in transport.control)
    receives = transport.receives  # 2 steps of 2 micro-batches of 2 tensors: waited for once, never looked at
    assert len(receives) == 8 and all(work.waits == 1 and not work.looked.is_set() for work in receives)


@pytest.mark.parametrize("predicted", [True, False])
def test_a_cpu_link_waits_as_on_gloo_without_polling(monkeypatch, predicted):
    transport = FakeTransport(lambda deliver: GlooLikeWork(deliver))
    sent, received = _send_and_receive(monkeypatch, transport, polled=False, predicted=predicted)
    for values, (count, got) in zip(sent, received):
        assert count == 2
        for value, activation in zip(values, got):
            for a, b in zip(value, activation):
                torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("predicted", [True, False])
def test_an_activation_crosses_a_link_in_its_memory_layout_or_the_one_its_step_message_announced(
    monkeypatch, predicted
):
    """A ``channels_last`` (or ``channels_last_3d``) activation arrives in that layout, a contiguous one contiguous,
    each with its values; where the step message announced another layout than the tensor has, it arrives in the
    announced one (the receiver allocated so before the tensor was computed), values unchanged. Its gradient comes
    back in the layout it crossed in."""
    monkeypatch.setattr(waiting, "polls", lambda device, group=None: False)
    transport = FakeTransport(lambda deliver: GlooLikeWork(deliver))
    monkeypatch.setattr(dist, "isend", transport.isend)
    monkeypatch.setattr(dist, "irecv", transport.irecv)
    job = Job()
    sender, receiver = Link(None, 1, torch.device("cpu"), job=job), Link(0, None, torch.device("cpu"), job=job)
    images = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    volumes = torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    value = (images, volumes, torch.randn(2, 3, 4, 5))
    announced = (images.contiguous(), volumes, images)  # the first contiguous, the third channels_last
    values = [value, value]
    sender.send_step(2, [signature(value), signature(announced)] if predicted else [None, None])
    for index, sent in enumerate(values):
        sender.send_activation(sent, index)
    sender.flush()
    count, _ = receiver.receive_step()
    got = [receiver.recv_activation() for _ in range(count)]
    formats = (torch.channels_last, torch.channels_last_3d, torch.contiguous_format)
    expected = [
        formats,
        (torch.contiguous_format, torch.channels_last_3d, torch.channels_last) if predicted else formats,
    ]
    for activation, layouts in zip(got, expected):
        for sent, arrived, memory_format in zip(value, activation, layouts):
            torch.testing.assert_close(arrived, sent, rtol=0, atol=0)
            assert arrived.is_contiguous(memory_format=memory_format)
    # the gradients go back in the layouts the activations came in, whatever layout autograd gave them
    for index, activation in enumerate(got):
        grads = [
            torch.full_like(t, float(i + 1), memory_format=torch.contiguous_format) for i, t in enumerate(activation)
        ]
        receiver.send_grads(grads, index, activation)
        sender.post_grads([(t.shape, t.dtype) for t in activation], index)
        for grad, back, memory_format in zip(grads, sender.recv_grads(index), expected[index]):
            torch.testing.assert_close(back, grad, rtol=0, atol=0)
            assert back.is_contiguous(memory_format=memory_format)


def test_a_polled_collective_reads_the_received_size_only_once_it_has_arrived(monkeypatch):
    obj = {"logged": [1.5, 2.5], "step": 17}
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sent = [torch.tensor([data.numel()], dtype=torch.int64), data]
    works = []

    def broadcast(tensor, src, group=None, async_op=False):
        message = sent.pop(0)
        works.append(NcclLikeWork(polls=3, deliver=lambda: tensor.copy_(message)))
        return works[-1]

    monkeypatch.setattr(waiting, "polls", lambda device, group=None: True)
    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert waiting.broadcast_object(Job(), None, src=0) == obj
    assert len(works) == 2 and all(work.waits == 1 and work.early_waits == 0 for work in works)


class Sent:
    """What a test knows of one send: weak references to its tensor and work (the work holds the tensor, as
    ProcessGroupGloo's ``SendWork`` does and an NCCL work for the caching allocator), and its ``wait()`` calls."""

    def __init__(self, tensor: torch.Tensor, work) -> None:
        self.tensor, self.work = weakref.ref(tensor), weakref.ref(work)
        self.waits = self.early_waits = 0

    def alive(self) -> bool:
        """Whether the tensor is still referenced (freed by reference counting: no garbage collection needed)."""
        return self.tensor() is not None


class NcclLikeSend(NcclLikeWork):
    """An :class:`NcclLikeWork` of a send, completed only when told to; counts its waits in its :class:`Sent`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self.tensor, self.sent = tensor, Sent(tensor, self)

    def wait(self) -> bool:
        self.sent.waits += 1
        self.sent.early_waits += not self.done.is_set()
        return super().wait()


class GlooLikeSend(GlooLikeWork):
    """A :class:`GlooLikeWork` of a send: ``wait()`` blocks until :meth:`complete`, then raises ``error`` if given;
    a second ``wait()`` fails (gloo's would block)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(blocks=True)
        self.tensor, self.sent, self.error = tensor, Sent(tensor, self), None

    def complete(self) -> None:
        self.done.set()

    def wait(self) -> bool:
        self.sent.waits += 1
        assert self.sent.waits == 1, "a gloo send was waited for twice: the second wait() would block"
        super().wait()
        if self.error is not None:
            raise self.error
        return True


class SendLog:
    """Stands for ``dist.isend`` on a link of ``backend`` (``"nccl"``: polled, ``"gloo"``: watched by a helper thread
    of the job), whose payload sends complete only when told to; keeps only a :class:`Sent` of each. The step's
    step message (its control message, on gloo) announces every activation's shapes, so none is headed."""

    def __init__(self, monkeypatch, job: Job, backend: str) -> None:
        self.job, self.backend = job, backend
        self.sent: list[Sent] = []
        monkeypatch.setattr(waiting, "polls", lambda device, group=None: backend == "nccl")
        monkeypatch.setattr(dist, "isend", self.isend)
        self.link = Link(None, 1, torch.device("cpu"), job=job)
        self.link.send_step(3, [signature(torch.zeros(3, 4))] * 3)

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
        if tag >= CONTROL_TAG:
            return GlooLikeWork()  # the step message, received at once
        work = NcclLikeSend(tensor) if self.backend == "nccl" else GlooLikeSend(tensor)
        self.sent.append(work.sent)
        return work

    def send(self, index: int) -> list[Sent]:
        """Send micro-batch ``index``'s activation (one tensor); its send."""
        self.link.send_activation(torch.randn(3, 4), index)
        return self.sent[-1:]

    def complete(self, sends: list[Sent], error: Exception | None = None) -> None:
        """Complete ``sends`` (with ``error``: as failed), and let the link's helper thread see it (gloo)."""
        for sent in sends:
            sent.work().error = error
            sent.work().complete()
        if self.backend == "gloo":  # a stream's thread is FIFO: a batch watched after them completes after them
            self.job.waiter.watch([], (1, 0)).wait()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_link_drops_its_completed_sends_when_it_posts_the_next_one(monkeypatch, job, backend):
    log = SendLog(monkeypatch, job, backend)
    first = log.send(0)
    log.complete(first)
    assert all(sent.alive() for sent in first)  # nothing posted since: still referenced
    second = log.send(1)
    assert not any(sent.alive() for sent in first)  # neither the link, nor a helper thread, nor the work keeps them
    assert all(sent.alive() for sent in second)  # not completed: kept alive for the transport
    assert [(sent.waits, sent.early_waits) for sent in first] == [(1, 0)]  # waited for once, when completed
    log.complete(second)
    log.link.flush()
    assert not any(sent.alive() for sent in second)


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_failed_send_that_completed_raises_at_the_next_send(monkeypatch, job, backend):
    log = SendLog(monkeypatch, job, backend)
    log.complete(log.send(0), error=RuntimeError("Connection reset by peer"))
    with pytest.raises(PipelineFailure, match=r"another stage stopped responding \(Connection reset by peer\)"):
        log.send(1)


def test_a_flush_through_a_micro_batch_waits_for_its_sends_only(monkeypatch, job):
    log = SendLog(monkeypatch, job, "gloo")
    first, second, third = log.send(0), log.send(1), log.send(2)
    threading.Thread(target=lambda: first[0].work().entered.wait() and log.complete(first), daemon=True).start()
    log.link.flush(through=0)  # waits for the first send, which completes while it waits
    assert [sent.alive() for sent in first + second + third] == [False, True, True]
    log.complete(second + third)
    log.link.flush()
    assert [sent.waits for sent in first + second + third] == [1, 1, 1]
    assert not any(sent.alive() for sent in second + third)


def test_an_nccl_like_flush_waits_for_no_payload_and_drops_those_that_completed(monkeypatch, job):
    """On NCCL the compute stream is ordered after the transfers: a flush keeps the sends that have not completed
    alive, without the host waiting for the device, and drops those that have."""
    log = SendLog(monkeypatch, job, "nccl")
    first, second = log.send(0), log.send(1)
    log.complete(second)
    log.link.flush()
    assert [sent.alive() for sent in first + second] == [True, False]
    assert [(sent.waits, sent.early_waits) for sent in first + second] == [(0, 0), (1, 0)]
    log.complete(first)
    log.link.flush()
    assert not first[0].alive()


def test_a_turn_hands_copies_between_two_chunks_of_one_process_in_order(monkeypatch):
    """Where a V turns, the two chunks' link is a Turn: no transfer (``isend`` would fail here), each activation and
    gradient taken in the order sent, a copy the receiver cannot change the sender's tensors through."""
    monkeypatch.setattr(dist, "isend", None)
    monkeypatch.setattr(dist, "irecv", None)
    turn, job = Turn(), Job()
    sender = Link(None, 0, torch.device("cpu"), job=job, turns=(None, turn))
    receiver = Link(0, None, torch.device("cpu"), job=job, turns=(turn, None))
    with pytest.raises(RuntimeError, match="took from the turn of its V before the other model chunk sent to it"):
        receiver.receive_step()
    outputs = [torch.randn(2, 3), (torch.randn(2, 3), torch.ones(2, dtype=torch.bool))]
    sender.send_step(2, [None, None])
    for index, output in enumerate(outputs):
        sender.send_activation(output, index)
    count, _ = receiver.receive_step()
    first = receiver.recv_activation()
    assert count == 2 and torch.equal(first, outputs[0]) and first.data_ptr() != outputs[0].data_ptr()
    second = receiver.recv_activation()
    assert isinstance(second, tuple) and all(torch.equal(a, b) for a, b in zip(second, outputs[1]))
    sender.post_grads([(torch.Size([2, 3]), torch.float32)])
    gradient = torch.randn(2, 3)
    receiver.send_grads([gradient], 0)
    gradient.zero_()
    (got,) = sender.recv_grads(0)
    assert got.abs().sum() > 0
    sender.flush()
    receiver.flush()
