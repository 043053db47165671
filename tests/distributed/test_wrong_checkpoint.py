"""A checkpoint of another model, or a damaged one, never (half-)loads: one run of 2 stage processes
(tests/workers/wrong_checkpoint.py) resumes a model of 3 linear layers from checkpoints of a deeper, a shallower
and a wider one, in both layouts, and from a truncated file and a truncated shard. Each must fail on every stage
before the first step, with what the model says without a pipeline or naming the file; with
``strict_loading=False`` the entries that fit load."""

import json

import pytest
import torch
from conftest import assert_every_stage_exits, shared_run

from lightning_gpipe.lightning.consolidate import main

WRONG_CHECKPOINTS = shared_run("wrong_checkpoint.py", devices=2, timeout=300)

KEYS = [*(f"backbone.{i}.{kind}" for i in range(3) for kind in ("weight", "bias")), "head.weight", "head.bias"]
"""The model's state-dict keys."""


@pytest.fixture(scope="module")
def run():
    """The worker's output directory; every stage process has exited."""
    out = WRONG_CHECKPOINTS()
    assert_every_stage_exits(out, within=30)
    return out


@pytest.fixture(scope="module")
def cases(run):
    """Each rank's ``{case: {"error": ..., "batches": ...}}``."""
    return [json.loads((run / f"cases_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("layout", ["full", "sharded"])
@pytest.mark.parametrize("model", ["deeper", "shallower", "wider"])
def test_a_resume_from_another_models_checkpoint_fails_before_step_1_as_without_a_pipeline(run, cases, model, layout):
    plain = json.loads((run / "plain.json").read_text())[model]
    assert plain.startswith("RuntimeError: Error(s) in loading state_dict for Stack:\n\t"), plain
    expected = {
        "deeper": 'Unexpected key(s) in state_dict: "backbone.3.weight", "backbone.3.bias", "backbone.4.weight", '
        '"backbone.4.bias". ',
        "shallower": 'Missing key(s) in state_dict: "backbone.2.weight", "backbone.2.bias". ',
        "wider": "size mismatch for backbone.0.weight: copying a param with shape torch.Size([12, 16]) from"
        " checkpoint, the shape in current model is torch.Size([8, 16]).",
    }[model]
    assert expected in plain
    for rank, results in enumerate(cases):
        result = results[f"resume_{model}_{layout}"]
        assert result["error"] == plain, f"rank {rank}: {result['error']}"
        assert result["batches"] == 0, f"rank {rank}"


def test_strict_loading_false_loads_the_entries_that_fit(run, cases):
    for model in ("deeper", "shallower"):
        saved = torch.load(run / f"{model}.ckpt", weights_only=False)["state_dict"]
        for layout in ("full", "sharded"):
            case = f"lenient_{model}_{layout}"
            assert [results[case]["error"] for results in cases] == ["no error"] * 2, case
            state = torch.load(run / f"{case}.pt")
            assert list(state) == KEYS, case
            common = state.keys() & saved.keys()
            assert len(common) == {"deeper": 8, "shallower": 6}[model], case
            for key in common:
                torch.testing.assert_close(state[key], saved[key], rtol=0, atol=0, msg=f"{case}: {key}")


@pytest.mark.parametrize(
    "case, damaged",
    [("truncated_file", "truncated.ckpt"), ("truncated_shard", "truncated_sharded.ckpt/__1_0.distcp")],
)
def test_a_truncated_checkpoint_names_its_file(run, cases, case, damaged):
    expected = f"DamagedCheckpointError: The checkpoint file {run / damaged} is damaged or truncated"
    for rank, results in enumerate(cases):
        assert results[case]["error"].startswith(expected), f"rank {rank}: {results[case]['error']}"
        assert results[case]["batches"] == 0, f"rank {rank}"


def test_the_command_names_a_truncated_shard(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main([str(run / "truncated_sharded.ckpt"), str(tmp_path / "model.ckpt")])
    assert exit.value.code == 2
    shard = run / "truncated_sharded.ckpt" / "__1_0.distcp"
    assert f"The checkpoint file {shard} is damaged or truncated: it holds " in capsys.readouterr().err
    assert not (tmp_path / "model.ckpt").exists()
