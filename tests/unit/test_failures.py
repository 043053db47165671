"""Failures and stalls, checked in this process on a ``HashStore``: the waiting mechanism and the stall watchdog's
diagnosis (on stage processes: tests/distributed/test_failures.py)."""

import json
import re
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_gpipe import PipelineFailure
from lightning_gpipe.engine.actions import Action, Kind
from lightning_gpipe.engine.pipeline import Runtime
from lightning_gpipe.engine.transfer import Link
from lightning_gpipe.faults import waiting, watchdog
from lightning_gpipe.faults.job import Job
from lightning_gpipe.faults.watchdog import Position
from lightning_gpipe.lightning.config import STALL_LIMIT_NOTE


class _BlockingWork:
    """Stands for a ``dist.Work`` whose ``wait()`` blocks in C++ until :attr:`done` is set (:attr:`entered` once
    ``wait()`` is called)."""

    def __init__(self) -> None:
        self.done, self.entered = threading.Event(), threading.Event()

    def wait(self) -> bool:
        self.entered.set()
        self.done.wait()
        return True


@pytest.fixture
def job():
    """A job (failure board and watchdog) on an in-process store, as stage 0 of a 2-stage pipeline."""
    names = {0: "stage 0", 1: "stage 1"}
    with Job(dist.HashStore(), 0, names, limit=1.5, processes=1, limit_note=STALL_LIMIT_NOTE) as job:
        yield job


def _publish_position(job, rank: int, age: float, waits_for=None, unbounded=False, phase="forward", micro=3):
    position = dict(step="step 17", phase=phase, micro_batch=micro, since=time.time() - age, waits_for=waits_for)
    job.board.store.set(job.board.key(f"where/{rank}"), json.dumps({**position, "unbounded": unbounded}))


def test_a_signal_is_handled_while_a_wait_blocks(monkeypatch):
    """The handler runs while the work is still blocking, not at the wait's next look at the board: with no look for
    an hour, the work completes only after the handler ran, or after 60 s if the handler waited for the work."""

    class Interrupted(Exception):
        pass

    work, handled, done_when_handled = _BlockingWork(), threading.Event(), []

    def handler(signum, frame):
        done_when_handled.append(work.done.is_set())
        handled.set()
        raise Interrupted

    def interrupt_then_complete():
        work.entered.wait()  # the helper thread blocks in the work's wait()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
        handled.wait(timeout=60)
        work.done.set()

    monkeypatch.setattr(waiting, "TICK", 3600.0)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Thread(target=interrupt_then_complete).start()
        with pytest.raises(Interrupted), Job() as job:
            waiting.wait(job, [work], "stage 1")
    finally:
        signal.signal(signal.SIGUSR1, previous)
        work.done.set()
    assert done_when_handled == [False]


def test_a_wait_returns_when_its_works_complete_and_raises_their_error():
    class Failing(_BlockingWork):
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    work = _BlockingWork()
    threading.Timer(0.2, work.done.set).start()
    with Job() as job:
        waiting.wait(job, [work], "stage 1")
        with pytest.raises(PipelineFailure, match=r"another stage stopped responding \(Connection closed by peer\)"):
            waiting.wait(job, [Failing()], "stage 1")


def test_the_watchdog_names_the_stage_that_stopped_and_tells_it_to_end(job):
    _publish_position(job, 1, age=300)
    work = _BlockingWork()
    with pytest.raises(PipelineFailure) as raised:
        waiting.wait(job, [work], "stage 1")
    assert not work.done.is_set()  # the stall ended the wait, not the work
    work.done.set()
    message = str(raised.value)
    assert message.startswith("stage 0 stopped because stage 1 has been in the forward of micro-batch 3 at step 17 for")
    limit = r"\(stall limit 2 s, the shorter of GPipeStrategy's"  # 1.5 s, shown rounded
    waited = re.search(rf"stage 0 gave up after waiting (\d+) s for stage 1 {limit}", message)
    assert waited and int(waited[1]) >= 2, message  # it waited the stall limit at least, then named the stage
    assert job.board.published_cause() == message.removeprefix("stage 0 stopped because ")
    assert job.board.store.get(job.board.key("stalled")) == b"1"


def test_the_watchdog_waits_on_through_unbounded_phases_and_names_stages_waiting_for_each_other(job):
    _publish_position(job, 1, age=300, unbounded=True, phase="writing a checkpoint", micro=None)
    assert job.watchdog.diagnose("stage 1", 400.0) is None
    _publish_position(job, 1, age=300, waits_for="stage 0", phase="recv", micro=2)
    message, culprit = job.watchdog.diagnose("stage 1", 400.0)
    assert culprit is None
    waits = "stage 1 waits for stage 0 in receiving the gradients of micro-batch 2 at step 17"
    assert message.startswith(f"the stages wait for each other: {waits}")


def test_a_wait_stops_when_another_stage_published_a_failure(job):
    job.board.publish("stage 1 failed with ValueError: boom")
    work = _BlockingWork()
    with pytest.raises(PipelineFailure, match="^stage 0 stopped because stage 1 failed with ValueError: boom$"):
        waiting.wait(job, [work], "stage 1")
    work.done.set()


def test_a_report_names_the_innermost_frame_without_reading_source_files(job):
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as error:
        job.board.report(error)
    cause = job.board.published_cause()
    assert cause.startswith("stage 0 failed with RuntimeError:") and "can't allocate memory" in cause
    line = test_a_report_names_the_innermost_frame_without_reading_source_files.__code__.co_firstlineno + 2
    assert cause.endswith(f"(at {__file__}:{line})")


class _RecordingChunk:
    """Stands for the first of two stages: its forwards record where the runtime says the stage is."""

    virtual_stage, checkpoint, defer_weight_grad, training, is_last, offload = 0, "never", False, True, False, None

    def __init__(self, position) -> None:
        self.position, self.seen = position, {}

    def inputs(self, value):
        return iter([(i, None, 3) for i in range(3)])

    def forward(self, index, x, micro_batches):
        self.seen[index] = self.position.record()
        return index

    def send(self, output, index):
        pass


def test_a_stuck_stages_message_names_the_action_of_its_plan(job, monkeypatch):
    now = time.time()  # the watchdog's clock, stopped: the ages it reads are the ones given here
    monkeypatch.setattr(watchdog, "time", SimpleNamespace(time=lambda: now, monotonic=time.monotonic))
    stage = _RecordingChunk(Position())
    runtime = Runtime([stage], "gpipe", 2, position=stage.position)
    stage.position.begin_step("step 17")
    runtime.forward(None)
    assert stage.position.action is None  # out of the plan once the fill has run
    plan = runtime.plan(3)
    number = plan.actions.index(Action(Kind.FORWARD, 1)) + 1
    record = {**stage.seen[1], "since": now - 300}
    job.board.store.set(job.board.key("where/1"), json.dumps(record))
    message, culprit = job.watchdog.diagnose("stage 1", 400.0)
    assert culprit == 1
    where = f"action {number} of {len(plan.actions)} of its plan, the forward of micro-batch 1, at step 17"
    assert message.startswith(f"stage 1 has been in {where} for 300 s; stage 0 gave up after waiting 400 s")
    # a phase inside the action (a span) follows the action in parentheses
    record["action"], record["phase"], record["micro_batch"] = (
        dict(number=7, of=9, kind="backward", micro_batch=2),
        "recv",
        2,
    )
    job.board.store.set(job.board.key("where/1"), json.dumps(record))
    message, _ = job.watchdog.diagnose("stage 1", 400.0)
    inside = "action 7 of 9 of its plan, the backward of micro-batch 2 (receiving the gradients of micro-batch 2)"
    assert message.startswith(f"stage 1 has been in {inside}, at step 17 for 300 s")
    # with virtual stages, the model chunk follows the action
    record["action"] = dict(number=7, of=9, kind="backward", micro_batch=2, model_chunk=1)
    job.board.store.set(job.board.key("where/1"), json.dumps(record))
    message, _ = job.watchdog.diagnose("stage 1", 400.0)
    assert "the backward of micro-batch 2 on model chunk 1 (receiving the gradients of micro-batch 2)" in message


def test_two_jobs_in_one_process_do_not_see_each_others_position_or_failure():
    names = {0: "stage 0", 1: "stage 1"}
    with Job(dist.HashStore(), 0, names, processes=1) as first, Job(dist.HashStore(), 1, names, processes=1) as second:
        first.position.at("writing a checkpoint")
        assert second.position.phase == "setup"
        first.board.publish("stage 0 failed with ValueError: boom")
        assert second.board.published_cause() is None
        assert first.board.published_cause() == "stage 0 failed with ValueError: boom"


def test_a_failure_of_an_earlier_run_is_not_read_by_a_later_one_in_the_same_processes():
    store = dist.HashStore()
    with Job(store, 0, {0: "stage 0"}) as earlier:
        earlier.board.publish("stage 0 failed with ValueError: boom")
    with Job(store, 0, {0: "stage 0"}) as later:
        assert later.board.published_cause() is None
        assert later.board.generation == earlier.board.generation + 1
    with Job(store, 1, {1: "stage 1"}) as other_rank:  # every process counts its own runs
        assert other_rank.board.generation == earlier.board.generation


class _LostStore:
    """Stands for the job's store once global rank 0's process, which holds it, has ended: every call fails."""

    def __getattr__(self, name):
        def lost(*args, **kwargs):
            raise dist.DistNetworkError("Broken pipe")

        return lost


def test_a_lost_store_ends_the_linger_and_names_global_rank_0s_process():
    # stage 1 after the main process (global rank 0, stage 0) was killed: its transfer failed, its store is gone
    with Job(None, 1, {0: "stage 0", 1: "stage 1"}) as job:
        job.board.store = _LostStore()
        job.board.linger()  # returns: nobody can read a cause there any more
        lost = re.escape("stage 1 stopped because global rank 0's process (stage 0) has ended: the job's store")
        with pytest.raises(PipelineFailure, match=rf"^{lost}.*\(Connection reset by peer\)$"):
            with job.board.as_pipeline_failure(detail=job.watchdog.last_positions):
                raise RuntimeError("Connection reset by peer")
        assert job.watchdog.last_positions().startswith("global rank 0's process (stage 0) has ended")


@pytest.mark.parametrize("transfer", ["receive", "send"])
def test_a_transfer_that_cannot_be_posted_is_a_pipeline_failure_naming_the_lost_peer(monkeypatch, transfer):
    # gloo refuses to post a transfer once the connection to the peer has closed
    def refused(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:29500")

    monkeypatch.setattr(dist, "irecv", refused)
    monkeypatch.setattr(dist, "isend", refused)
    with Job(None, 1, {0: "stage 0", 1: "stage 1"}) as job:
        job.board.store = _LostStore()
        link = Link(0, 0, torch.device("cpu"), job=job)
        with pytest.raises(PipelineFailure, match=r"^stage 1 stopped because global rank 0's process \(stage 0\)"):
            link.receive_step() if transfer == "receive" else link.send_step(1, [None])


def test_a_stage_recorder_moves_the_position_whether_or_not_it_records_spans():
    from lightning_gpipe.engine.events import TrackingRecorder

    position = Position()
    recorder = TrackingRecorder(position)
    with recorder.span("forward", 2):  # disabled: the position's own span, nothing recorded
        assert (position.phase, position.micro_batch) == ("forward", 2)
    assert recorder.spans == []
    recorder.enabled = True
    with recorder.span("backward", 1):
        assert (position.phase, position.micro_batch) == ("backward", 1)
    assert [(span.kind, span.micro_batch) for span in recorder.spans] == [("backward", 1)]
    recorder.enabled = False
    with recorder.span("recv", 3):
        assert position.phase == "recv"
    assert len(recorder.take()) == 1  # the enabled span only


def test_a_failure_on_one_tensor_rank_ends_every_process_of_the_stage_and_its_neighbours(monkeypatch):
    """pp=2 x tp=2 on one store: stage 0's tensor rank 1 fails. Its tensor partner, blocked in the stage's
    tensor-parallel all-reduce (torch's ``DTensor`` collective, outside the package's waits, so it never reads the
    board), is ended by its heartbeat once the grace has passed, naming the failure; stage 1's processes, waiting on
    their links through the package, stop at once naming it too."""
    from lightning_gpipe.engine import Topology

    topology = Topology(4, 2, tensor_parallel_size=2)
    names = {rank: topology.name(rank) for rank in range(4)}
    ended, partner_ended = [], threading.Event()

    def end_process():  # the heartbeat's exit (code 1), recorded instead (every heartbeat of the job may call it)
        ended.append((threading.current_thread().board.name, 1))
        partner_ended.set() if threading.current_thread().board.name == names[0] else None

    monkeypatch.setattr(watchdog, "end_process", end_process)
    monkeypatch.setattr(watchdog, "INTERVAL", 0.05)
    monkeypatch.setattr(watchdog, "GRACE", 0.2)
    monkeypatch.setattr(waiting, "TICK", 0.05)
    store, collective, links = dist.HashStore(), _BlockingWork(), [_BlockingWork(), _BlockingWork()]
    jobs = [Job(store, rank, names) for rank in range(4)]
    try:
        threading.Thread(target=collective.wait, daemon=True).start()  # tensor rank 0's all-reduce, never completed
        cause = f"{names[1]} failed with ValueError: boom"
        jobs[1].board.publish(cause)
        for rank, link in zip((2, 3), links):
            stopped = rf"^{re.escape(names[rank])} stopped because {re.escape(cause)}$"
            with pytest.raises(PipelineFailure, match=stopped):
                waiting.wait(jobs[rank], [link], names[rank - 2])
        assert partner_ended.wait(timeout=30) and not collective.done.is_set()
        assert (names[0], 1) in ended
    finally:
        for work in (collective, *links):
            work.done.set()
        for job in jobs:
            job.close()


def test_a_process_the_watchdog_ends_ends_its_child_processes_first():
    """A data loader's worker that hung in its fork (seen once: stuck in a library's at-fork handler) outlived the
    stage the watchdog ended, holding the job's output pipes open: the harness reading them never ended. The stage
    now kills its children before it exits."""
    import subprocess
    import sys

    script = (
        "import subprocess, sys\n"
        "from lightning_gpipe.faults.watchdog import _children, end_process\n"
        "quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], **quiet)\n"
        "assert _children(__import__('os').getpid()) == [child.pid]\n"
        "print(child.pid, flush=True)\n"
        "end_process()\n"
    )
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 1, ended.stderr
    child = int(ended.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not watchdog._ended(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watchdog._ended(child)
