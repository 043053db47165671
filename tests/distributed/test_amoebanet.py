"""The AmoebaNet-D example (examples/amoebanet) as a user runs it: `train.py fit` on 2 stage processes."""

import csv
import re

from conftest import SHORT_EXAMPLE_RUNS, example_beside, run_example

SCRIPT = "examples/amoebanet/train.py"
example_beside(SCRIPT, "fit", *SHORT_EXAMPLE_RUNS[SCRIPT], timeout=300)  # started beside the in-process tests


def test_example_trains_on_two_stages_and_logs_through_a_lightning_logger() -> None:
    """`train.py fit` from another directory: 2 stage processes (the example's default), shipped images, CSV metrics
    and checkpoint under ``--trainer.default_root_dir``, and a model summary of the whole model and its split. (4
    steps, validating every 2: the run of the README's command in tests/distributed/test_doc_commands.py, which reads
    the same run.)"""
    result, cwd, root = run_example(SCRIPT, "fit", *SHORT_EXAMPLE_RUNS[SCRIPT], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in result.stderr
    assert list(cwd.iterdir()) == []  # nothing in the working directory: logs follow default_root_dir
    (metrics,) = root.glob("lightning_logs/amoebanet/version_*/metrics.csv")
    assert list(metrics.parent.glob("checkpoints/*.ckpt"))
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    losses = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    assert any(row.get("val_acc") for row in rows)
    # the summary at fit start: the whole model (173,754 parameters), then each stage's layers and parameters
    output = result.stderr + result.stdout
    # quiet: no warning from the package's or the examples' code, Lightning's sync_dist advice, torch's LeafSpec
    # deprecation (from Lightning) or a progress bar's "Epoch 0/-2"
    assert not re.search(r"(lightning_gpipe|examples)/[\w/]+\.py:\d+: ", output), output[-3000:]
    assert "sync_dist" not in output and "LeafSpec" not in output and "/-2" not in output, output[-3000:]
    assert "173 K     Total params" in output and output.count("Total params") == 1
    lines = output.splitlines()
    split = lines.index("Split into 2 pipeline stages (the modules after the backbone are on its last stage):")
    stages = [[cell.strip() for cell in line.split("|")] for line in lines[split + 3 : split + 5]]
    assert [stage[0] for stage in stages] == ["0", "1"] and stages[0][1].startswith("stem .. ")
    assert stages[1][1].endswith(" .. head") and int(stages[0][2]) + int(stages[1][2]) == 10
