"""A sharded checkpoint opened without the strategy: ``python -m lightning_gpipe.consolidate`` and its helpers.

One 2-stage run of tests/workers/consolidate.py writes the same state at step 3 as a full checkpoint file and as a
sharded directory, consolidates the directory in-process, and resumes to step 6 from the directory and from the
consolidated file. Here the command runs on the directory as a user runs it (a subprocess, no process group), and
its file is compared with the full checkpoint, loaded into the plain module, and resumed on one device.
"""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_states_close, shared_run
from models import TupleNet, fit_trainer

import lightning_gpipe
from lightning_gpipe.lightning.consolidate import COMMAND, load_from_checkpoint, main

TWO_STAGES = shared_run("consolidate.py", devices=2, timeout=300)


@pytest.fixture(scope="module")
def run():
    """The worker's output directory (see the module docstring)."""
    return TWO_STAGES()


@pytest.fixture(scope="module")
def consolidated(run, tmp_path_factory):
    """The file ``python -m lightning_gpipe.consolidate`` writes from the run's sharded directory."""
    output = tmp_path_factory.mktemp("command") / "model.ckpt"
    command = [sys.executable, "-m", "lightning_gpipe.consolidate", str(run / "sharded.ckpt"), str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"Wrote {output}: 16 weight tensors"), result.stdout
    return output


def assert_same(actual, expected, where: str = "checkpoint") -> None:
    """Assert two checkpoint values are equal: the same nesting, keys and types, and bit-identical tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, where


def test_the_command_writes_what_a_full_run_writes(run, consolidated):
    checkpoint = torch.load(consolidated, weights_only=False)
    full = torch.load(run / "full.ckpt", weights_only=False)
    meta = torch.load(run / "sharded.ckpt" / "meta.pt", weights_only=False)
    assert checkpoint.keys() == full.keys() == meta.keys() | {"state_dict", "optimizer_states"}
    assert_same(checkpoint["state_dict"], full["state_dict"], "state_dict")  # every stage's, the original names
    assert checkpoint["state_dict"].keys() == TupleNet().state_dict().keys()
    assert_same(checkpoint["optimizer_states"], full["optimizer_states"], "optimizer_states")  # keyed by name
    assert "state.backbone.0.linear.weight.momentum_buffer" in checkpoint["optimizer_states"][0]
    assert "param_groups.head.weight.lr" in checkpoint["optimizer_states"][0]
    for key in meta:
        assert_same(checkpoint[key], meta[key], key)  # the trainer state, unchanged
        if key != "callbacks":  # ModelCheckpoint's state names the file it wrote, full.ckpt or sharded.ckpt
            assert_same(checkpoint[key], full[key], key)
    assert checkpoint["global_step"] == 3
    assert_same(torch.load(run / "consolidated.ckpt", weights_only=False), checkpoint)  # in-process: the same
    assert list(consolidated.parent.iterdir()) == [consolidated]  # no temporary file left


def test_the_consolidated_file_loads_without_the_strategy(run, consolidated):
    expected = torch.load(run / "full.ckpt", weights_only=False)["state_dict"]
    loaded = TupleNet.load_from_checkpoint(consolidated)  # Lightning's defaults, weights_only included
    assert_states_close(loaded.state_dict(), expected, atol=0)


def test_the_consolidated_file_resumes_on_one_device(consolidated, reference_state):
    trainer = fit_trainer(lightning_gpipe.GPipeStrategy(chunks=3), devices=1, max_steps=6, ckpt_path=consolidated)
    assert_states_close(trainer.lightning_module.state_dict(), reference_state)
    # Without the strategy, Lightning hands the name-keyed optimizer state to torch's Optimizer.load_state_dict,
    # which expects it keyed by position (docs/training.md says so): the weights load, the optimizer state does not.
    with pytest.raises(KeyError, match="param_groups"):
        fit_trainer(max_steps=6, ckpt_path=consolidated)


def test_the_consolidated_file_resumes_to_the_losses_of_the_directory(run, reference_state):
    losses = {kind: json.loads((run / f"losses_{kind}.json").read_text()) for kind in ("sharded", "consolidated")}
    assert len(losses["sharded"]) == 3  # steps 4, 5 and 6
    assert losses["consolidated"] == losses["sharded"]
    resumed = torch.load(run / "resume_consolidated.pt")
    assert_states_close(resumed, torch.load(run / "resume_sharded.pt"), atol=0)
    assert_states_close(resumed, reference_state)  # 6 uninterrupted steps on one device


def test_load_from_checkpoint_reads_a_sharded_directory(run, tmp_path):
    expected = torch.load(run / "full.ckpt", weights_only=False)["state_dict"]
    with pytest.raises(IsADirectoryError):  # Lightning's own loader reads files only
        TupleNet.load_from_checkpoint(run / "sharded.ckpt")
    assert_states_close(load_from_checkpoint(TupleNet, run / "sharded.ckpt").state_dict(), expected, atol=0)
    assert_states_close(load_from_checkpoint(TupleNet, run / "full.ckpt").state_dict(), expected, atol=0)
    with pytest.raises(FileNotFoundError, match="not a sharded GPipe checkpoint.*meta.pt"):
        load_from_checkpoint(TupleNet, tmp_path)


def _missing(run, directory):
    return directory / "missing"


def _empty(run, directory):
    return directory


def _checkpoint_file(run, directory):
    return run / "full.ckpt"


def _metadata_alone(run, directory):
    shutil.copy(run / "sharded.ckpt" / "meta.pt", directory)
    return directory


@pytest.mark.parametrize(
    "make, message",
    [
        (_missing, "does not exist"),
        (_empty, r"is not a sharded GPipe checkpoint: expected a directory written by .*meta\.pt is missing"),
        (_checkpoint_file, "is a file, not a sharded checkpoint directory: it is a single-file checkpoint already"),
        (_metadata_alone, "has meta.pt but no torch.distributed.checkpoint metadata"),
    ],
)
def test_the_command_refuses_what_is_not_a_sharded_checkpoint(run, tmp_path, capsys, make, message):
    (tmp_path / "in").mkdir()
    directory = make(run, tmp_path / "in")
    output = tmp_path / "model.ckpt"
    with pytest.raises(SystemExit) as exit:
        main([str(directory), str(output)])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"usage: {COMMAND}") and re.search(message, error), error
    assert not output.exists()


def test_the_command_keeps_an_existing_output_unless_forced(run, tmp_path, capsys):
    output = tmp_path / "model.ckpt"
    output.write_bytes(b"something the user saved")
    with pytest.raises(SystemExit) as exit:
        main([str(run / "sharded.ckpt"), str(output)])
    error = capsys.readouterr().err
    assert exit.value.code == 2 and f"{output} exists" in error and "--force" in error, error
    assert output.read_bytes() == b"something the user saved"
    with pytest.raises(SystemExit) as exit:  # a directory is never replaced, even with --force
        main([str(run / "sharded.ckpt"), str(tmp_path), "--force"])
    assert exit.value.code == 2 and "is a directory" in capsys.readouterr().err
    assert main([str(run / "sharded.ckpt"), str(output), "--force"]) == 0
    assert capsys.readouterr().out.startswith(f"Wrote {output}: ")
    assert_same(torch.load(output, weights_only=False), torch.load(run / "consolidated.ckpt", weights_only=False))
    assert list(tmp_path.iterdir()) == [output]  # no temporary file left
