"""A failure or a stall on one stage ends every process within 60 s, naming the stage and the original error.

Distributed runs (tests/workers/failure.py) for what needs several processes; the waiting mechanism and the
stall watchdog's diagnosis are checked in this process, on a ``HashStore``.
"""

import json
import os
import re
import signal
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import process_exits, run_worker, start_worker
from models import TupleNet, fit

from lightning_gpipe import PipelineFailure, waiting
from lightning_gpipe.job import Job
from lightning_gpipe.runtime import Runtime
from lightning_gpipe.schedule import Action, Kind
from lightning_gpipe.watchdog import Position

CASES = {
    "validation": ["stage 1 failed with ValueError: boom in validation", "stage 0 stopped because stage 1 failed"],
    "before_backbone": [
        "`self.head` was called on stage 0, before the backbone call",
        "stage 1 stopped because stage 0 failed with RuntimeError",
    ],
    "double": [
        "stage 0 stopped because stage 1 failed with RuntimeError: `training_step` called the pipelined backbone a"
        " second time in one step; it must call it exactly once per step"
    ],
    "oom": [
        "stage 0 stopped because stage 1 failed with RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0."
        " DefaultCPUAllocator: can't allocate memory: you tried to allocate 16384 bytes."
    ],
}


def _assert_every_stage_exits(out, within: float = 60, since: float | None = None):
    for rank in range(2):
        pid, started = (out / f"rank{rank}.txt").read_text().split()
        left = within - (time.time() - (since or float(started)))
        assert process_exits(int(pid), within=left), f"rank {rank} is left"


@pytest.mark.parametrize("case", CASES)
def test_failure_ends_every_stage(case, tmp_path):
    result = run_worker("failure.py", case, str(tmp_path), timeout=180)
    assert result.returncode != 0
    for message in CASES[case]:
        assert message in result.stderr, result.stderr[-3000:]
    _assert_every_stage_exits(tmp_path)


def test_a_stage_stuck_in_user_code_is_named_by_the_watchdog(tmp_path):
    result = run_worker("failure.py", "stuck", str(tmp_path), "--stall", "4", timeout=180)
    assert result.returncode != 0
    named = "stage 0 stopped because stage 1 has been in `training_step` after the backbone call at step 2 for"
    assert named in result.stderr, result.stderr[-3000:]
    # the wait is checked once a second (waiting.TICK), so on a busy machine it may have lasted 5 s or more
    assert re.search(
        r"stage 0 gave up after waiting \d+ s for stage 1 \(stall limit 4 s, the shorter of", result.stderr
    )
    assert "[stage 1] ending this process: stage 1 has been in" in result.stderr  # the stuck stage is ended too
    _assert_every_stage_exits(tmp_path)


@pytest.mark.parametrize("inherited", ["handled", "ignored"])
def test_ctrl_c_on_the_main_process_ends_every_stage_while_one_is_stuck(inherited, tmp_path):
    # "ignored": started as a background job of a non-interactive shell starts it, where `kill -INT` did nothing
    process = start_worker("failure.py", "stuck", str(tmp_path), ignore_sigint=inherited == "ignored")
    deadline = time.time() + 150
    while not (tmp_path / "stuck").exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # stage 0 waits for the stuck stage's gradients
    sent = time.time()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in stderr, stderr[-3000:]
    assert "[stage 0] interrupted; ending every stage. stage 1 was last seen in `training_step` after" in stderr
    _assert_every_stage_exits(tmp_path, within=30, since=sent)


def test_sigterm_on_the_main_process_stops_every_stage_at_the_same_step(tmp_path):
    process = start_worker("failure.py", "sigterm", str(tmp_path))
    deadline = time.time() + 150
    while not (tmp_path / "training").exists():
        assert process.poll() is None and time.time() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.2)
    sent = time.time()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert (tmp_path / "stopped_rank0").exists() and (tmp_path / "stopped_rank1").exists(), stderr[-3000:]
    assert "PipelineFailure" not in stderr and process.returncode == 0  # Lightning's graceful stop, on both stages
    _assert_every_stage_exits(tmp_path, within=30, since=sent)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_slurm_requeue_signal_saves_a_checkpoint_every_stage_agrees_on_requeues_and_ends_every_stage(tmp_path):
    # a 2-task SLURM job started as srun would; `scontrol` on PATH records its arguments
    (tmp_path / "bin").mkdir()
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol_calls"}\n')
    scontrol.chmod(0o755)
    job = dict(
        SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="1", SLURM_NODEID="0", SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="gpipe", SLURM_NODELIST="127.0.0.1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
    )  # fmt: skip
    tasks = [
        start_worker(
            "failure.py", "requeue", str(tmp_path), env={**job, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}
        )
        for r in range(2)
    ]
    deadline = time.time() + 150
    while not (tmp_path / "training").exists():
        assert all(t.poll() is None for t in tasks) and time.time() < deadline, tasks[0].communicate()[1][-3000:]
        time.sleep(0.2)
    for task in tasks:  # SLURM signals every task of the job (`--signal=USR1@90`), each at its own point of a step
        task.send_signal(signal.SIGUSR1)
    outputs = [task.communicate(timeout=60) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 4242\n"  # once, from global rank 0
    (step,) = {int((tmp_path / f"stopped_rank{r}").read_text()) for r in range(2)}  # both stop at the same step
    (checkpoint,) = tmp_path.glob("hpc_ckpt_*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    loaded = TupleNet.load_from_checkpoint(checkpoint).state_dict()  # both stages' layers, after the same step
    for key, expected in fit(max_steps=step).state_dict().items():
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=1e-5, msg=key)
    _assert_every_stage_exits(tmp_path)


def test_a_stage_killed_mid_save_leaves_the_previous_checkpoint_which_resumes(tmp_path, reference_state):
    # full: global rank 0 dies halfway through writing the file; sharded: the last stage dies after writing its shard
    for kind in ("full", "sharded"):
        result = run_worker("failure.py", f"kill_{kind}", str(tmp_path), timeout=180)
        assert result.returncode != 0 and (tmp_path / f"killed_{kind}").exists(), result.stderr[-3000:]
        _assert_every_stage_exits(tmp_path)
    assert "terminated with code -9" in result.stderr  # Lightning's launcher ends the job (sharded: a child died)
    assert (tmp_path / ".good_sharded.ckpt.partial").is_dir()  # the unfinished sharded checkpoint, left aside
    loaded = TupleNet.load_from_checkpoint(tmp_path / "good_full.ckpt").state_dict()
    for key, expected in fit(max_steps=3).state_dict().items():
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=1e-5)
    result = run_worker("failure.py", "resume", str(tmp_path), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    for kind in ("full", "sharded"):
        resumed = torch.load(tmp_path / f"resumed_{kind}.pt")
        for key, expected in reference_state.items():
            torch.testing.assert_close(resumed[key], expected, rtol=0, atol=1e-5, msg=f"{kind}: {key}")


# ----------------------------------------------------------------------------- in this process


class _BlockingWork:
    """Stands for a ``dist.Work`` whose ``wait()`` blocks in C++ until :attr:`done` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def wait(self) -> bool:
        self.done.wait()
        return True


@pytest.fixture
def job():
    """A job (failure board and watchdog) on an in-process store, as stage 0 of a 2-stage pipeline."""
    with Job(dist.HashStore(), 0, {0: "stage 0", 1: "stage 1"}, limit=1.5, processes=1) as job:
        yield job


def _publish_position(job, rank: int, age: float, waits_for=None, unbounded=False, phase="forward", micro=3):
    position = dict(step="step 17", phase=phase, micro_batch=micro, since=time.time() - age, waits_for=waits_for)
    job.board.store.set(job.board.key(f"where/{rank}"), json.dumps({**position, "unbounded": unbounded}))


def test_a_signal_is_handled_while_a_wait_blocks():
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    work, previous = _BlockingWork(), signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        started = time.monotonic()
        with pytest.raises(Interrupted), Job() as job:
            waiting.wait(job, [work], "stage 1")
        assert time.monotonic() - started < 1.0  # handled at once, not at the next look at the board
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        work.done.set()


def test_a_wait_returns_when_its_works_complete_and_raises_their_error():
    class Failing(_BlockingWork):
        def wait(self):
            raise RuntimeError("Connection closed by peer")

    work, job = _BlockingWork(), Job()
    threading.Timer(0.2, work.done.set).start()
    waiting.wait(job, [work], "stage 1")
    with pytest.raises(PipelineFailure, match=r"another stage stopped responding \(Connection closed by peer\)"):
        waiting.wait(job, [Failing()], "stage 1")
    job.close()


def test_the_watchdog_names_the_stage_that_stopped_and_tells_it_to_end(job):
    _publish_position(job, 1, age=300)
    work = _BlockingWork()
    started = time.monotonic()
    with pytest.raises(PipelineFailure) as raised:
        waiting.wait(job, [work], "stage 1")
    work.done.set()
    assert 1.5 < time.monotonic() - started < 4.0
    message = str(raised.value)
    assert message.startswith("stage 0 stopped because stage 1 has been in the forward of micro-batch 3 at step 17 for")
    assert "stage 0 gave up after waiting 2 s for stage 1 (stall limit 2 s, the shorter of GPipeStrategy's" in message
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


class _RecordingStage:
    """Stands for the first of two stages: its forwards record where the runtime says the stage is."""

    stage_index, checkpoint, defer_weight_grad, training, is_last = 0, "never", False, True, False

    def __init__(self, position) -> None:
        self.position, self.seen = position, {}

    def micro_batches(self, value):
        return iter([(i, None, 3) for i in range(3)])

    def forward(self, index, x, count):
        self.seen[index] = self.position.record()
        return index

    def send(self, output, index, count):
        pass


def test_a_stuck_stages_message_names_the_action_of_its_plan(job):
    stage = _RecordingStage(Position())
    runtime = Runtime(stage, "gpipe", 2, position=stage.position)
    stage.position.begin_step("step 17")
    runtime.forward(None)
    assert stage.position.action is None  # out of the plan once the fill has run
    plan = runtime.plan(3)
    number = plan.actions.index(Action(Kind.FORWARD, 1)) + 1
    record = {**stage.seen[1], "since": time.time() - 300}
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
