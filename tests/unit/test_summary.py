"""PipelineModelSummary in-process: the whole model from stage parts, the swap for Lightning's summary, and the
plain behaviour under other strategies.

The two-process path (the gather at fit start under GPipeStrategy) runs in the examples' smoke tests
(tests/distributed/test_amoebanet.py, tests/distributed/test_translation.py), which check the printed summary of a
real 2-stage run.
"""

import copy
import logging
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import summarize
from models import TupleNet, fit_trainer
from nonchain import FEATURES, VOCAB, TiedNet
from torch import nn

from lightning_gpipe import PipelineModelSummary
from lightning_gpipe.engine.actions import stage_of_virtual
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.ties import find_ties
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.callbacks import replace_model_summary
from lightning_gpipe.lightning.summary import StageSummary, _format, _layer_range, _local_part, _merge
from lightning_gpipe.planning.balance import resolve_balance


class Net(TupleNet):
    """TupleNet with a frozen first layer and a parameter held by the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(1))
        self.backbone[0].requires_grad_(False)


def stage_module(
    model: L.LightningModule, balance: list[int], stage: int, num_stages: int | None = None, v_shape: bool = False
) -> tuple[L.LightningModule, nn.Module, bool]:
    """A copy of ``model`` split as stage ``stage`` holds it (:class:`~lightning_gpipe.engine.partition.Split`: its
    backbone layers under their names, those of every virtual stage on it, ``balance`` having one entry per virtual
    stage; a placeholder for each module outside the backbone with parameters, but on the stage that ends the
    backbone: the last, or stage 0 in a V); and whether it is that stage."""
    num_stages = num_stages or len(balance)
    virtual = [v for v in range(len(balance)) if stage_of_virtual(v, num_stages, v_shape)[0] == stage]
    split = Split(copy.deepcopy(model), "backbone", balance, stage, num_stages, virtual)
    return split.module, split.partition, len(balance) - 1 in virtual


def stage_part(model: L.LightningModule, balance: list[int], stage: int, max_depth: int = 1, **v):
    """Stage ``stage``'s part of the summary (see :func:`stage_module`), with its tied copies that another stage
    counts, as ``TiedParameters.uncounted`` gives them."""
    module, partition, holds_head = stage_module(model, balance, stage, **v)
    ties = find_ties(model, "backbone", balance, v.get("num_stages"), v.get("v_shape", False))
    copies = [module.get_parameter(t.local_name(stage)) for t in ties if stage in t.stages and t.stages[0] != stage]
    return _local_part(module, partition, stage, max_depth, holds_head, copies)


@pytest.mark.parametrize("max_depth", [1, 2, -1])
def test_stage_parts_merge_into_the_whole_models_summary(max_depth) -> None:
    """Rows, parameter counts and modes of 3 stages add up to Lightning's summary of the unsplit module."""
    model, balance = Net(), [2, 3, 3]
    parts = [stage_part(model, balance, k, max_depth) for k in range(3)]
    table, stages = _merge([parts[2], parts[0], parts[1]])  # in any order, as gathered
    plain = summarize(model, max_depth=max_depth)
    assert [row.name for row in table.rows] == plain.layer_names
    assert [row.parameters for row in table.rows] == plain.param_nums
    assert [row.type for row in table.rows] == ["Sequential (3 stages)", *plain.layer_types[1:]]
    assert (table.total, table.trainable) == (plain.total_parameters, plain.trainable_parameters)
    assert table.trainable == table.total - 272  # the frozen Fork
    assert table.leftover == max(plain.total_parameters - plain.total_layer_params, 0) == (max_depth == 1)
    assert sum(table.modes.values()) == plain.total_training_modes["train"] and len(table.modes) == 17
    block = 16 * 16 + 16
    assert stages == [
        StageSummary(0, ("0", "1"), 2 * block + 1, block + 1),
        StageSummary(1, ("2", "3", "4"), 3 * block + 1, 3 * block + 1),
        StageSummary(2, ("5", "6", "7"), 2 * block + 16 * 3 + 3 + 1, 2 * block + 16 * 3 + 3 + 1),
    ]


def test_printed_summary_shows_totals_and_the_split() -> None:
    model, balance = Net(), [2, 6]
    parts = [stage_part(model, balance, k) for k in range(2)]
    table, stages = _merge(parts)
    text = _format(table, stages, precision_bits=32)
    lines = text.splitlines()
    assert cells(lines[0]) == ["", "Name", "Type", "Params", "Mode"]
    assert [cells(line) for line in lines[2:5]] == [
        ["0", "backbone", "Sequential (2 stages)", "1.9 K", "train"],
        ["1", "head", "Linear", "51", "train"],
        ["", "other params", "n/a", "1", "n/a"],
    ]
    assert lines[6:12] == [
        "1.7 K     Trainable params",
        "272       Non-trainable params",
        "2.0 K     Total params",
        "0.008     Total estimated model params size (MB)",
        "17        Modules in train mode",
        "0         Modules in eval mode",
    ]
    assert lines[12] == "Split into 2 pipeline stages (the modules after the backbone are on its last stage):"
    assert [cells(line) for line in (lines[13], *lines[15:17])] == [
        ["Stage", "Backbone layers", "Layers", "Params", "Share"],
        ["0", "0-1", "2", "545", "28%"],
        ["1", "2-7", "6", "1.4 K", "72%"],
    ]
    assert len(lines) == 18


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("|")]


def test_a_parameter_tied_across_stages_counts_once_in_the_totals_and_the_backbone() -> None:
    """TiedNet on 3 stages: the embedding (stage 0) is the head's weight (stage 2), one Linear is at backbone positions
    1 (stage 0) and 5 (stage 2). The totals and rows equal Lightning's summary of the whole module; each stage's row
    counts the copies it holds."""
    model, balance = TiedNet(), [3, 2, 2]
    table, stages = _merge([stage_part(model, balance, k) for k in range(3)])
    plain = summarize(model, max_depth=1)
    assert (table.total, table.trainable) == (plain.total_parameters, plain.trainable_parameters)
    assert [(row.name, row.parameters) for row in table.rows] == list(zip(plain.layer_names, plain.param_nums))
    embedding, linear = VOCAB * FEATURES, FEATURES * FEATURES + FEATURES
    assert plain.total_parameters == embedding + 2 * linear
    assert [s.parameters for s in stages] == [embedding + linear, linear, linear + embedding]  # the copies held
    assert "Total params" in _format(table, stages, precision_bits=32)


def test_under_zb_v_the_summary_names_stage_0_for_the_modules_after_the_backbone() -> None:
    """In ZB-V's V (K = 2, virtual stages 0 and 3 on stage 0) the head is on stage 0: the split line says so, and the
    head's row is the head's (its type, mode and parameters), not stage 1's placeholder."""
    model, balance = Net(), [2, 2, 2, 2]
    parts = [stage_part(model, balance, k, num_stages=2, v_shape=True) for k in range(2)]
    table, stages = _merge(parts)
    plain = summarize(model, max_depth=1)
    assert [(row.name, row.type, row.parameters) for row in table.rows] == [
        ("backbone", "Sequential (2 stages)", plain.param_nums[0]),
        ("head", "Linear", plain.param_nums[1]),
    ]
    assert table.total == plain.total_parameters and [s.layers for s in stages] == [tuple("0167"), tuple("2345")]
    text = _format(table, stages, precision_bits=32)
    assert "Split into 2 pipeline stages (the modules after the backbone are on stage 0):" in text.splitlines()


def test_the_summary_docs_observability_md_shows_is_what_the_default_amoebanet_prints() -> None:
    """docs/observability.md's summary of the default AmoebaNet-D (6, 16) on 2 stages, split as the strategy splits it
    (``balance="params"``), is what the summary prints (each line without trailing blanks; the real 2-process run
    prints the same: tests/distributed/test_amoebanet.py)."""
    from amoebanet.module import AmoebaNetClassifier

    model = AmoebaNetClassifier()
    balance = resolve_balance("params", model.backbone, 2)
    table, stages = _merge([stage_part(model, balance, k) for k in range(2)])
    printed = [line.rstrip() for line in _format(table, stages, precision_bits=32).splitlines()]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text(encoding="utf-8")
    block = docs.split("For the default AmoebaNet-D (6, 16) on 2 stages:\n\n```text\n")[1].split("\n```")[0]
    assert block.splitlines() == printed


def test_layer_ranges_name_the_first_and_last_layer() -> None:
    assert _layer_range(("0", "1", "2", "3", "4")) == "0-4"
    assert _layer_range(("0", "1", "6", "7")) == "0-1, 6-7"  # two model chunks (ZB-V's stage 0 of K = 2, M = 8)
    assert _layer_range(("3", "5", "6")) == "3, 5-6"
    assert _layer_range(("stem", "normal1_1", "reduction1")) == "stem .. reduction1"
    assert _layer_range(("head",)) == "head" and _layer_range(()) == "-"


def summary_callbacks(trainer: L.Trainer) -> list[L.Callback]:
    return [c for c in trainer.callbacks if isinstance(c, ModelSummary)]


def test_replace_swaps_lightnings_summaries_in_place_keeping_max_depth() -> None:
    default = L.Trainer(accelerator="cpu", logger=False)
    (lightning_default,) = summary_callbacks(default)
    index = default.callbacks.index(lightning_default)
    new = replace_model_summary(default)
    assert type(new) is PipelineModelSummary and new.max_depth == 1 and default.callbacks[index] is new
    assert summary_callbacks(default) == [new] and replace_model_summary(default) is new  # idempotent

    rich = L.Trainer(accelerator="cpu", logger=False, callbacks=[RichModelSummary(max_depth=3)])
    new = replace_model_summary(rich)
    assert type(new) is PipelineModelSummary and new.max_depth == 3 and summary_callbacks(rich) == [new]

    class Mine(ModelSummary):
        pass

    own = Mine(max_depth=2)
    trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[own])
    assert replace_model_summary(trainer) is own and summary_callbacks(trainer) == [own]
    quiet = L.Trainer(accelerator="cpu", logger=False, enable_model_summary=False)
    assert replace_model_summary(quiet) is None and summary_callbacks(quiet) == []


def test_max_depth_must_be_minus_one_or_more() -> None:
    with pytest.raises(ValueError, match="max_depth=-2"):
        PipelineModelSummary(max_depth=-2)
    with pytest.raises(ValueError, match="max_depth=1.5"):
        PipelineModelSummary(max_depth=1.5)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("callback", [ModelSummary, PipelineModelSummary])
def test_without_gpipe_it_prints_what_lightnings_summary_prints(callback) -> None:
    handler, logger = Collect(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    logger.addHandler(handler)
    try:
        fit_trainer(max_steps=1, callbacks=[callback(max_depth=2)], enable_model_summary=True)
    finally:
        logger.removeHandler(handler)
    (message,) = handler.messages
    assert message == "\n" + str(summarize(TupleNet(), max_depth=2))
    assert "1 | backbone.0 | Fork" in message


def test_on_fit_start_gathers_the_stages_and_prints_on_rank_zero() -> None:
    """The GPipe path of the hook in one process: a one-process group, a strategy as GPipeStrategy shows it."""
    from types import SimpleNamespace

    import torch.distributed as dist

    model = Net()
    module, partition, _ = stage_module(model, [8], 0)
    run = SimpleNamespace(
        partition=partition, pipeline=SimpleNamespace(is_last=True), ties=SimpleNamespace(uncounted=list)
    )
    strategy = SimpleNamespace(run=run, stage_index=0, job=Job())
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True, precision="bf16-true")
    handler, logger = Collect(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    summary = PipelineModelSummary()
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    logger.addHandler(handler)
    try:
        summary.on_fit_start(trainer, module)
        PipelineModelSummary(max_depth=0).on_fit_start(trainer, module)  # off: no gather, nothing printed
    finally:
        logger.removeHandler(handler)
        dist.destroy_process_group()
    (message,) = handler.messages
    assert "2.0 K     Total params" in message and "0.004     Total estimated model params size (MB)" in message
    assert "Sequential (1 stage)" in message and "Split into 1 pipeline stage (" in message
    assert "| 0-7             | 8      | 2.0 K  | 100%" in message
    assert summary.stages == [StageSummary(0, tuple("01234567"), 1956, 1684)]
    assert (summary.total_parameters, summary.trainable_parameters) == (1956, 1684)
