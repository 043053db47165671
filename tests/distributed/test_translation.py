"""The translation example (examples/translation) on stage processes.

The headline test trains the example's Transformer (tiny, dropout 0) for 20 steps of variable-length,
token-bucketed batches on 2 pipeline stages (and 3, with the whole grid: tests/grid.py) and checks that the loss
curve equals single-device training, then that decoding through the pipeline (``forward_and_share``; greedy with
and without the key/value cache, beam search) gives the same translations as decoding the same weights on one
device. Then `train.py fit` runs as a user runs it, on 2 stages.
"""

import csv

import pytest
import torch
import yaml
from conftest import SHORT_EXAMPLE_RUNS, example_beside, run_example, shared_run
from grid import FULL
from tiny_translation import DECODINGS, EXAMPLE, STEPS, TINY, fit_tiny, one_thread, predict_data
from translation.data import DIRECTIONS
from translation.module import TranslationModule


@pytest.fixture(scope="module")
def reference() -> tuple[TranslationModule, list[float]]:
    """The tiny model and its loss curve after single-device training (the ground truth)."""
    with one_thread():
        return fit_tiny()


STAGES = (2, 3) if FULL else (2,)
"""The pipelines the model trains on: 3 stages (an odd split of its encoder and decoder) with the whole grid only."""

PIPELINED = {k: shared_run("translation.py", f"--devices={k}", devices=k, timeout=400) for k in STAGES}


@pytest.mark.parametrize("stages", STAGES)
def test_pipeline_loss_curve_and_decoding_equal_single_device(stages, reference) -> None:
    """K stages: same 20-step loss curve (relative 1e-4), same translations of the trained weights (greedy with
    and without the key/value cache, beam 4)."""
    out = PIPELINED[stages]()
    _, expected = reference
    losses = torch.load(out / "losses.pt")
    assert len(losses) == len(expected) == STEPS
    assert losses[-1] < losses[0]
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: pipelined {got}, single device {want}"
    module = TranslationModule(**TINY)
    module.load_state_dict(torch.load(out / "state.pt"))
    module.eval()
    pipelined = [torch.load(out / f"translations_rank{rank}.pt") for rank in range(stages)]
    for name, decoding in DECODINGS.items():
        for attribute, value in decoding.items():
            setattr(module, attribute, value)
        translations = [line for i, batch in enumerate(predict_data()) for line in module.predict_step(batch, i)]
        assert len(translations) == 6 and all(isinstance(sentence, str) for sentence in translations)
        for rank in range(stages):
            got = [sentence for batch in pipelined[rank][name] for sentence in batch]
            assert got == translations, f"rank {rank}, {name}"


SCRIPT = "examples/translation/train.py"
example_beside(SCRIPT, "fit", "--trainer.devices=2", *SHORT_EXAMPLE_RUNS[SCRIPT], timeout=300)  # beside the tests


def test_example_trains_on_two_stages_and_logs_bleu_and_throughput() -> None:
    """`train.py fit` from a directory with no shared data beside it: 2 stages, shipped subset, CSV metrics under
    ``--trainer.default_root_dir``, a model summary of the whole model and its split. (3 steps, one validation:
    the run of the README's command in tests/distributed/test_doc_commands.py, which reads the same run.)"""
    result, cwd, root = run_example(SCRIPT, "fit", "--trainer.devices=2", *SHORT_EXAMPLE_RUNS[SCRIPT], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in result.stderr
    assert list(cwd.iterdir()) == []  # nothing in the working directory: logs follow default_root_dir
    (metrics,) = root.glob("lightning_logs/translation/version_*/metrics.csv")
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    (validation,) = [row for row in rows if row.get("val_loss")]
    assert float(validation["val_ppl"]) > 1
    assert all(0 <= float(validation[f"val_bleu_{d.replace('-', '_')}"]) <= 100 for d in DIRECTIONS)
    tokens = [float(row["throughput/lengths"]) for row in rows if row.get("throughput/lengths")]  # tokens so far
    assert len(tokens) == 3 and 0 < tokens[0] < tokens[1] < tokens[2]
    assert all(0 <= float(row["pipeline/bubble"]) < 1 for row in rows if row.get("pipeline/bubble"))
    # the summary at fit start: the whole model's parameters, then the 9 backbone layers split over the stages
    with torch.device("meta"):
        module = TranslationModule(**yaml.safe_load((EXAMPLE / "configs" / "cpu.yaml").read_text())["model"])
    total = sum(parameter.numel() for parameter in module.parameters())
    output = result.stderr + result.stdout
    assert f"{total / 1e6:.1f} M     Total params" in output and output.count("Total params") == 1
    lines = output.splitlines()
    split = lines.index("Split into 2 pipeline stages (the modules after the backbone are on its last stage):")
    stages = [[cell.strip() for cell in line.split("|")] for line in lines[split + 3 : split + 5]]
    assert [stage[0] for stage in stages] == ["0", "1"] and stages[0][1].startswith("0-")
    first_of_second = int(stages[1][1].split("-")[0]) if "-" in stages[1][1] else int(stages[1][1])
    assert first_of_second == int(stages[0][2]) and int(stages[0][2]) + int(stages[1][2]) == 9
