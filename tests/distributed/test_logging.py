"""What user code logs on the last stage reaches the logger, the callbacks and every rank."""

import csv
import json

import pytest
import torch
from conftest import shared_run
from models import LoggedNet, logged_fit


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


PIPELINED = shared_run("logging_relay.py", devices=2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reference = tmp_path_factory.mktemp("reference")
    trainer = logged_fit(str(reference))
    pipelined = PIPELINED()
    return reference, trainer, pipelined


def test_logger_on_rank_zero_writes_what_single_device_writes(runs):
    reference, _, pipelined = runs
    expected, got = _rows(reference / "logs/version_0/metrics.csv"), _rows(pipelined / "logs/version_0/metrics.csv")
    assert got[0].keys() == expected[0].keys()
    assert {"train_loss", "train_acc_step", "train_acc_epoch", "val_loss", "val_acc"} <= got[0].keys()
    assert len(got) == len(expected)
    for row, ref in zip(got, expected):
        for key, value in ref.items():
            assert (value == "") == (row[key] == ""), key
            if value:
                assert float(row[key]) == pytest.approx(float(value), abs=1e-5), key


def test_callback_metrics_equal_on_every_rank(runs):
    _, trainer, pipelined = runs
    expected = {key: float(value) for key, value in trainer.callback_metrics.items()}
    for rank in range(2):
        got = json.loads((pipelined / f"callback_rank{rank}.json").read_text())
        assert got["callback_metrics"] == pytest.approx(expected, abs=1e-5)
        assert got["best_score"] == pytest.approx(float(trainer.checkpoint_callback.best_model_score), abs=1e-5)


def test_checkpoint_holds_the_whole_model_and_loads_without_the_strategy(runs):
    reference, _, pipelined = runs
    (path,) = (pipelined / "checkpoints").glob("*.ckpt")
    (expected_path,) = (reference / "checkpoints").glob("*.ckpt")
    assert path.name == expected_path.name
    module = LoggedNet.load_from_checkpoint(path)
    expected = torch.load(expected_path, weights_only=False)["state_dict"]
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=1e-5)
