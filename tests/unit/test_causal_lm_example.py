"""examples/causal_lm: the fitted model's directory under ``--trainer.default_root_dir`` (as the logs), and the data's
three kinds of batches (padded, under a token budget, packed) on the shipped sentences."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

from causal_lm.data import TextDataModule  # noqa: E402
from causal_lm.train import main  # noqa: E402

from lightning_gpipe.hf import SavePretrained  # noqa: E402


def _save_dir(cli) -> Path:
    return next(c for c in cli.trainer.callbacks if isinstance(c, SavePretrained)).dirpath


def test_the_fitted_model_goes_under_default_root_dir_not_the_working_directory(tmp_path, monkeypatch):
    """It was written to ``causal_lm_model/`` in the working directory whatever ``default_root_dir`` said."""
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "runs" / "first"
    assert _save_dir(main([f"--trainer.default_root_dir={root}"], run=False)) == root / "causal_lm_model"
    assert _save_dir(main([], run=False)) == tmp_path / "causal_lm_model"  # the working directory when not given
    given = main(["--save_pretrained.dirpath=elsewhere", f"--trainer.default_root_dir={root}"], run=False)
    assert _save_dir(given) == Path("elsewhere")  # a path of your own is used as it is


def _batches(**options) -> list[dict]:
    data = TextDataModule(val_rows=10, **options)
    data.setup()
    return list(data.train_dataloader()), data


def test_packed_batches_hold_every_sentence_once_in_rows_under_the_token_budget():
    batches, data = _batches(packing=True, max_tokens=1024, max_length=64)
    seen = []
    for batch in batches:
        ids, mask, positions = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
        assert ids.shape[0] == batch["num_rows"] <= 1024 // 64 and ids.shape[1] <= 64
        assert batch["num_targets"] == int((batch["labels"] != -100).sum())
        for row in range(ids.shape[0]):
            starts = [i for i in range(ids.shape[1]) if mask[row, i] and positions[row, i] == 0] + [
                int(mask[row].sum())
            ]
            seen += [ids[row, a:b].tolist() for a, b in zip(starts, starts[1:])]
    assert sorted(seen) == sorted(data.train)
    real = sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["input_ids"].numel() for b in batches)
    assert real > 0.95  # next fit leaves little of a row empty


def test_budget_batches_keep_rows_times_longest_under_the_budget_and_count_their_targets():
    batches, data = _batches(max_tokens=1024)
    assert sum(b["num_rows"] for b in batches) == len(data.train)
    for batch in batches:
        assert batch["input_ids"].numel() <= 1024 and "position_ids" not in batch
        assert batch["num_targets"] == int((batch["labels"][:, 1:] != -100).sum())
    default, _ = _batches()
    assert {b["input_ids"].shape[0] for b in default[:-1]} == {32}  # batch_size sentences without a budget
    assert torch.equal(default[0]["labels"] == -100, default[0]["attention_mask"] == 0)
