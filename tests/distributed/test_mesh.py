"""Pipeline x data parallelism: a (pipeline, data) mesh trains exactly like one device on the same global batch.

Every distributed run is tests/workers/mesh.py; the reference is plain single-device Lightning reading the same
global batches (Lightning's ``DistributedSampler`` order, :func:`models.ddp_order_loader`). Compared are global
rank 0's module after fit (every parameter, fp32, 1e-5) and the ``sync_dist=True`` training loss it saw. The
mesh's sizes, its errors and rank mapping are checked in the test process: tests/unit/test_mesh.py.
"""

import os
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
from conftest import (
    WORKERS,
    assert_every_stage_exits,
    assert_states_close,
    beside,
    run_worker,
    scratch,
    shared_run,
    started_environment,
)
from models import LossRecorder, SyncNet, ddp_order_loader, loader, trainer_kwargs

REFERENCE = {  # which single-device run each configuration of the worker must equal
    "pp2_dp2": {},
    "pp2_dp2_clip": {"gradient_clip_val": 0.05},
    "pp2_dp2_accumulate": {"accumulate_grad_batches": 2},
    "pp2_dp2_1f1b": {"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    "pp2_dp2_zb_h1": {"gradient_clip_val": 0.05},
    "pp2_dp2_interleaved": {"gradient_clip_val": 0.05},
    "pp1_dp4": {},
    "pp4_dp1_resumed": {},
    "pp1_dp4_resumed": {},
    "pp4_dp1_sharded_resumed": {},
    "pp4_dp1_from_v2_resumed": {},
    "pp4_dp1_from_zb_v_resumed": {},
}
NAMED_ONLY = {"pp2_dp2_full_shard": {}}  # the worker runs it only where named: in the torchrun test


MESH = shared_run("mesh.py", "--devices=4", devices=4, timeout=600)
"""The worker's configurations under Lightning's launcher, in the 4-process launch the other tests share."""


def _reference(**overrides) -> tuple[dict, list[float]]:
    L.seed_everything(1, verbose=False)
    recorder = LossRecorder()
    trainer = L.Trainer(devices=1, max_steps=6, **trainer_kwargs(callbacks=[recorder], **overrides))
    trainer.fit(SyncNet(), ddp_order_loader())
    return trainer.lightning_module.state_dict(), recorder.losses


def _assert_equals_reference(out, names) -> None:
    references = {}
    for name in names:
        _assert_equals_one_device(out, name, references)


def _assert_equals_one_device(out, name, references) -> None:
    try:
        overrides = {**REFERENCE, **NAMED_ONLY}[name]
        key = tuple(sorted(overrides.items()))
        if key not in references:
            references[key] = _reference(**overrides)
        state, losses = references[key]
        got = torch.load(out / f"{name}.pt")
        assert_states_close(got["state"], state)
        resumed = name.endswith("resumed")  # its recorder saw the steps after the checkpoint only
        expected = losses[-len(got["losses"]) :] if resumed else losses
        torch.testing.assert_close(got["losses"], expected, atol=1e-5, rtol=0)
        assert len(got["losses"]) == (2 if resumed else len(losses))
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from error


def test_mesh_trains_like_one_device_and_resumes_on_other_shapes():
    """(2, 2) plain, with clipping, accumulation, 1F1B with both, and ZB-H1 with clipping; (1, 4); a (2, 2)
    checkpoint (full and sharded) resumed as (4, 1) and (1, 4): all equal one device on the same global batches
    (Lightning's launcher, 4 processes); and each replica predicts its shard."""
    out = MESH()
    _assert_equals_reference(out, REFERENCE)
    assert torch.load(out / "pp2_dp2.pt")["environment"] == "LightningEnvironment"
    module = SyncNet()
    module.load_state_dict(torch.load(out / "pp2_dp2.pt")["state"])
    x, _ = loader().dataset.tensors
    shard = x[0::2]  # replica 0's rows under Lightning's unshuffled prediction sampler
    expected = [module.predict_step((part, None), i).detach() for i, part in enumerate(shard.split(20))]
    predictions = torch.load(out / "pp2_dp2_predictions.pt")
    assert len(predictions) == len(expected)
    for got, want in zip(predictions, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no staging directory left


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_all(commands: list[list[str]], envs: list[dict], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command, env in zip(commands, envs)
    ]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def _environment(**extra: str) -> dict:
    drop = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR")
    inherited = started_environment()
    env = {k: v for k, v in inherited.items() if k not in drop and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS.parent), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def _torchrun_nodes(tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """Two ``torchrun --nnodes=2 --node-rank=i`` commands of 2 processes each (TorchElasticEnvironment), with DDP and
    with each stage's state sharded over its replicas (FSDP2's ``FULL_SHARD``), writing to ``tmp_path``."""
    port = _free_port()
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            str(WORKERS / "mesh.py"),
            str(tmp_path),
            "--devices=2",
            "--num-nodes=2",
            "--configs",
            "pp2_dp2",
            "pp2_dp2_full_shard",
        ]  # fmt: skip
        for node in range(2)
    ]
    return _run_all(commands, [_environment(), _environment()])


def _slurm_tasks(tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """4 processes with the ``SLURM_*`` variables ``srun -N 2 --ntasks-per-node=2`` sets (SLURMEnvironment), writing
    to ``tmp_path``."""
    port, job = _free_port(), str(90000 + os.getpid() % 1000)
    slurm = dict(SLURM_NTASKS="4", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID=job)
    slurm.update(SLURM_JOB_NAME="mesh", SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    envs = [
        _environment(**slurm, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(rank // 2))
        for rank in range(4)
    ]
    command = [sys.executable, str(WORKERS / "mesh.py"), str(tmp_path), "--devices=2", "--num-nodes=2"]
    return _run_all([command + ["--configs", "pp2_dp2"]] * 4, envs)


def _failing_rank(tmp_path: Path) -> tuple[subprocess.CompletedProcess, AssertionError | None]:
    """4 processes of which global rank 2 fails, writing to ``tmp_path``: ``(the result, what
    :func:`conftest.assert_every_stage_exits` raised right after it, or None)``."""
    result = run_worker("mesh.py", str(tmp_path), "--devices=4", "--fail-rank=2", timeout=400)
    try:
        assert_every_stage_exits(tmp_path, processes=4)
    except AssertionError as error:
        return result, error
    return result, None


LAUNCHES = {"torchrun": _torchrun_nodes, "slurm": _slurm_tasks, "failure": _failing_rank}
"""The runs each test below reads, each writing to a directory of its own, started beside the in-process tests."""
OUTS = {name: scratch(f"mesh_{name}_") for name in LAUNCHES}
RESULTS = {name: beside(f"mesh:{name}", partial(launch, OUTS[name])) for name, launch in LAUNCHES.items()}


def test_two_torchrun_nodes_train_like_one_device():
    results, tmp_path = RESULTS["torchrun"](), OUTS["torchrun"]
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    _assert_equals_reference(tmp_path, ["pp2_dp2", "pp2_dp2_full_shard"])
    assert torch.load(tmp_path / "pp2_dp2_full_shard.pt")["environment"] == "TorchElasticEnvironment"


def test_slurm_environment_trains_like_one_device():
    results, tmp_path = RESULTS["slurm"](), OUTS["slurm"]
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    _assert_equals_reference(tmp_path, ["pp2_dp2"])
    assert torch.load(tmp_path / "pp2_dp2.pt")["environment"] == "SLURMEnvironment"


def test_a_failure_on_one_process_ends_all_four_naming_its_stage_and_replica():
    (result, left), tmp_path = RESULTS["failure"](), OUTS["failure"]
    assert result.returncode != 0
    message = (tmp_path / "failure.txt").read_text()
    assert (
        "stage 0 of replica 0 (rank 0) stopped because stage 0 of replica 1 (rank 2) failed with ValueError: boom"
        in message
    ), message
    if left is not None:  # a process outlived the run by more than assert_every_stage_exits allows
        raise left
