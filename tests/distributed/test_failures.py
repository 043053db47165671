"""A failure or a stall on one stage ends every process within 60 s, naming the stage and the original error.

Runs of tests/workers/failure.py on stage processes; the waiting mechanism and the stall watchdog's diagnosis are
checked in the test process: tests/unit/test_failures.py.
"""

import os
import re
import signal
import socket
import subprocess
import time
from contextlib import suppress
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import assert_every_stage_exits, beside, run_worker, scratch, start_worker, wait_for_file
from grid import suite
from models import TupleNet, fit

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
    "layer_dict": ["stage 0 stopped because stage 1 failed with TypeError: Backbone layer 8 (Returns) returned a dict"],
    "layer_scalar": [
        "stage 0 stopped because stage 1 failed with ValueError: Backbone layer 8 (Returns) returned a 0-dimensional"
    ],
    "float_labels": ["stage 0 stopped because stage 1 failed with RuntimeError: expected target dtype to be Long"],
}
"""Each case's messages; every case exits with code 1 (the error's), not by a signal: the stage waiting for the
failed one when it exits ends its waits first (lightning_gpipe.faults.job.end_waits_at_exit). The suite runs a failure
outside training, one the strategy raises and one of memory (:mod:`grid`): the others' messages are the same
mechanism's, their errors checked in one process by tests/unit/test_bad_inputs.py and test_units.py."""
CASES = suite(CASES, "validation", "double", "oom")

RUN = 400
"""Seconds a run may take before it counts as hung: far beyond a run's minute or so, which a busy machine (two runs at
once beside other work on two cores) can double, so that only a hang reaches it."""

ENDED = 120
"""Seconds the main process of a signalled run may take to end: a hang only, as :data:`RUN`."""


def _exits(out: Path, within: float = 60, since: float | None = None) -> AssertionError | None:
    """What :func:`conftest.assert_every_stage_exits` raises for the run on ``out`` (every stage gone within ``within``
    seconds of ``since``, by default of the run's end), or ``None``: called right after the run ends, where the test
    alone called it, for the test to raise when it reads the run."""
    try:
        assert_every_stage_exits(out, within=within, since=since)
    except AssertionError as error:
        return error
    return None


def _failing_run(case: str, out: Path, *args: str) -> tuple[subprocess.CompletedProcess, AssertionError | None]:
    """Run ``case`` on ``out`` (with the worker's options ``args``): ``(the result, :func:`_exits`)``."""
    result = run_worker("failure.py", case, str(out), *args, timeout=RUN)
    return result, _exits(out)


def _killed_mid_save_then_resumed(out: Path) -> tuple[list, subprocess.CompletedProcess]:
    """Run ``kill_full`` then ``kill_sharded`` on ``out``, then ``resume`` from the checkpoints they left there:
    ``([:func:`_failing_run` of each kill], the resume's result)``."""
    killed = [_failing_run(f"kill_{kind}", out) for kind in ("full", "sharded")]
    return killed, run_worker("failure.py", "resume", str(out), timeout=RUN)


def _signalled_run(
    case: str, out: Path, handshake: str, signum: int, ignore_sigint: bool = False, end_what_is_left: bool = False
) -> tuple[subprocess.CompletedProcess, AssertionError | None]:
    """Start ``case`` on ``out``, send ``signum`` to its main process once it writes ``out/handshake`` and wait for
    it: ``(the result, :func:`_exits` within 60 s of the signal)``; ``end_what_is_left`` kills what is left of the
    run before that check, even if this fails."""
    process = start_worker("failure.py", case, str(out), ignore_sigint=ignore_sigint)
    try:
        wait_for_file(out / handshake, process)
        sent = time.time()
        process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=ENDED)
    finally:
        if end_what_is_left:
            _end_processes_of(out)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), _exits(out, 60, sent)


SIGNALLED = {
    "interrupted": ("stuck", "waiting", signal.SIGINT, False, False),  # stage 0 waits for the stuck stage's gradients
    "interrupted_ignoring_sigint": ("stuck", "waiting", signal.SIGINT, True, False),
    "sigterm": ("sigterm", "training", signal.SIGTERM, False, False),
    "killed_before_the_store": ("before_the_store", "paused", signal.SIGKILL, False, True),  # rank 1 waits for it
    "killed_while_training": ("sigterm", "training", signal.SIGKILL, False, True),
}
"""The runs a test signals: ``{name: (case, handshake, signal, ignore_sigint, end_what_is_left)}`` (see
:func:`_signalled_run`)."""


def _registered() -> dict:
    """``{name: (result function, output directory)}``: the killed saves and their resume (three launches one after
    the other, registered first as the longest job), the stage stuck past its stall limit, the SLURM job, the run on a
    port in use, each case of :data:`CASES` and each run of :data:`SIGNALLED`, each a launch of its own, started
    beside the in-process tests (:func:`conftest.beside`)."""
    alone = {
        "killed_mid_save": _killed_mid_save_then_resumed,
        "stalled": lambda out: _failing_run("stuck", out, "--stall", "4"),
        "requeued": _requeued_slurm_job,
        "port_in_use": _run_on_a_port_in_use,
    }
    outs = {name: scratch(f"failures_{name}_") for name in (*alone, *CASES, *SIGNALLED)}
    jobs = {name: partial(run, outs[name]) for name, run in alone.items()}
    jobs.update({case: partial(_failing_run, case, outs[case]) for case in CASES})
    for name, (case, handshake, signum, ignore, end) in SIGNALLED.items():
        jobs[name] = partial(_signalled_run, case, outs[name], handshake, signum, ignore, end)
    return {name: (beside(f"failures:{name}", job), outs[name]) for name, job in jobs.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    """The runs of :func:`_registered`, by name."""
    return RUNS


def _raise(error: AssertionError | None) -> None:
    """Raise ``error`` (:func:`_exits`'s), if any."""
    if error is not None:
        raise error


@pytest.mark.parametrize("case", CASES)
def test_failure_ends_every_stage_with_exit_code_1(case, runs):
    result, exits = runs[case][0]()
    assert result.returncode == 1, result.stderr[-3000:]
    for message in CASES[case]:
        assert message in result.stderr, result.stderr[-3000:]
    _raise(exits)


def test_a_stage_stuck_in_user_code_is_named_by_the_watchdog(runs):
    result, exits = runs["stalled"][0]()  # stall limit 4 s
    assert result.returncode != 0
    named = "stage 0 stopped because stage 1 has been in `training_step` after the backbone call at step 2 for"
    assert named in result.stderr, result.stderr[-3000:]
    # the wait is checked once a second (waiting.TICK), so on a busy machine it may have lasted 5 s or more
    assert re.search(
        r"stage 0 gave up after waiting \d+ s for stage 1 \(stall limit 4 s, the shorter of", result.stderr
    )
    assert "[stage 1] ending this process: stage 1 has been in" in result.stderr  # the stuck stage is ended too
    _raise(exits)


@pytest.mark.parametrize("inherited", ["handled", "ignored"])
def test_ctrl_c_on_the_main_process_ends_every_stage_while_one_is_stuck(inherited, runs):
    # "ignored": started as a background job of a non-interactive shell starts it, where `kill -INT` did nothing
    result, exits = runs["interrupted" if inherited == "handled" else "interrupted_ignoring_sigint"][0]()
    stderr = result.stderr
    assert result.returncode != 0
    assert "Detected KeyboardInterrupt, attempting graceful shutdown" in stderr, stderr[-3000:]
    assert "[stage 0] interrupted; ending every stage. stage 1 was last seen in `training_step` after" in stderr
    _raise(exits)


def test_sigterm_on_the_main_process_stops_every_stage_at_the_same_step(runs):
    result_of, out = runs["sigterm"]
    result, exits = result_of()
    stderr = result.stderr
    assert (out / "stopped_rank0").exists() and (out / "stopped_rank1").exists(), stderr[-3000:]
    assert "PipelineFailure" not in stderr and result.returncode == 0  # Lightning's graceful stop, on both stages
    _raise(exits)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _requeued_slurm_job(tmp_path: Path) -> tuple[list[subprocess.CompletedProcess], AssertionError | None]:
    """Run ``requeue`` on ``tmp_path`` as the 2 tasks of a SLURM job, started as srun would (`scontrol` on PATH
    records its arguments), each sent SIGUSR1 once training: ``(each task's result, :func:`_exits`)``."""
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
    wait_for_file(tmp_path / "training", *tasks)
    for task in tasks:  # SLURM signals every task of the job (`--signal=USR1@90`), each at its own point of a step
        task.send_signal(signal.SIGUSR1)
    outputs = [task.communicate(timeout=ENDED) for task in tasks]
    results = [subprocess.CompletedProcess(t.args, t.returncode, *output) for t, output in zip(tasks, outputs)]
    return results, _exits(tmp_path)


def test_slurm_requeue_signal_saves_a_checkpoint_every_stage_agrees_on_requeues_and_ends_every_stage(runs):
    (results, exits), tmp_path = runs["requeued"][0](), runs["requeued"][1]
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-3000:] + results[1].stderr[-3000:]
    assert (tmp_path / "scontrol_calls").read_text() == "requeue 4242\n"  # once, from global rank 0
    (step,) = {int((tmp_path / f"stopped_rank{r}").read_text()) for r in range(2)}  # both stop at the same step
    (checkpoint,) = tmp_path.glob("hpc_ckpt_*.ckpt")
    assert torch.load(checkpoint, weights_only=False)["global_step"] == step
    loaded = TupleNet.load_from_checkpoint(checkpoint).state_dict()  # both stages' layers, after the same step
    for key, expected in fit(max_steps=step).state_dict().items():
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=1e-5, msg=key)
    _raise(exits)


def test_a_stage_killed_mid_save_leaves_the_previous_checkpoint_which_resumes(runs, reference_state):
    # full: global rank 0 dies halfway through writing the file; sharded: the last stage dies after writing its shard
    (killed, resume), tmp_path = runs["killed_mid_save"][0](), runs["killed_mid_save"][1]
    for kind, (result, exits) in zip(("full", "sharded"), killed):
        assert result.returncode != 0 and (tmp_path / f"killed_{kind}").exists(), result.stderr[-3000:]
        _raise(exits)
    assert "terminated with code -9" in result.stderr  # Lightning's launcher ends the job (sharded: a child died)
    assert (tmp_path / ".good_sharded.ckpt.partial").is_dir()  # the unfinished sharded checkpoint, left aside
    loaded = TupleNet.load_from_checkpoint(tmp_path / "good_full.ckpt").state_dict()
    for key, expected in fit(max_steps=3).state_dict().items():
        torch.testing.assert_close(loaded[key], expected, rtol=0, atol=1e-5)
    assert resume.returncode == 0, resume.stderr[-3000:]
    for kind in ("full", "sharded"):
        resumed = torch.load(tmp_path / f"resumed_{kind}.pt")
        for key, expected in reference_state.items():
            torch.testing.assert_close(resumed[key], expected, rtol=0, atol=1e-5, msg=f"{kind}: {key}")


def _processes_of(out: Path) -> list[int]:
    """The running processes of a worker started on ``out`` (an argument of theirs; a zombie has none)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(out).encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # ended meanwhile
            pass
    return pids


def _end_processes_of(out: Path) -> None:
    """Kill what a failed test left behind, so that it does not outlive the test."""
    for pid in _processes_of(out):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_on_a_port_in_use(tmp_path: Path) -> tuple[subprocess.CompletedProcess, int, list[int]]:
    """Run ``validation`` on ``tmp_path`` with MASTER_PORT a port another program listens on: ``(the result, the
    port, the run's processes left once it ended)``; those are then killed."""
    with socket.socket() as foreign:
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        port = foreign.getsockname()[1]
        try:
            env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            result = run_worker("failure.py", "validation", str(tmp_path), env=env, timeout=RUN)
        finally:
            left = _processes_of(tmp_path)
            _end_processes_of(tmp_path)
    return result, port, left


def test_a_port_in_use_names_the_port_and_leaves_no_process_behind(runs):
    # another program listens on MASTER_PORT: global rank 0 cannot create the job's store, and the processes it
    # launched (which would wait for the store until the process group's timeout) end with it
    result, port, left = runs["port_in_use"][0]()
    assert result.returncode == 1 and left == [], result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]  # the error the user sees last is the cause, naming the fix
    assert last.startswith(f"torch.distributed.DistNetworkError: MASTER_PORT={port} is in use on 127.0.0.1"), last
    assert "Set MASTER_PORT to a free port" in last


def test_the_processes_a_killed_main_process_launched_end_before_the_jobs_store_exists(runs):
    result_of, out = runs["killed_before_the_store"]
    result, exits = result_of()  # its output ends once rank 1, which shares it, has ended
    pid = (out / "rank0.txt").read_text().split()[0]  # the main process's (global rank 0, started by the test)
    launched = f"[stage 1] ending this process: the process that launched this one (pid {pid}) has ended"
    assert launched in result.stderr
    _raise(exits)


def test_a_killed_main_process_is_named_by_the_stage_that_waited_for_it(runs):
    result, exits = runs["killed_while_training"][0]()
    stderr = result.stderr
    last = [line for line in stderr.splitlines() if line.startswith("[rank1]: ")][-1]
    lost = "stage 1 stopped because global rank 0's process (stage 0) has ended: the job's store"
    assert last.startswith(f"[rank1]: lightning_gpipe.faults.failure.PipelineFailure: {lost}"), stderr[-3000:]
    _raise(exits)


RUNS = _registered()
"""The runs the tests read (registered at import, after the functions they call)."""
