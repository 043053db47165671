"""The pipeline callbacks without GPipeStrategy (each warns and does nothing), and PipelineBalance's report, suggestion
and table on step traces of given times: what it makes of known costs, where a real run's measured times would decide
(on a real 2-stage run, which checks the report's shape only: tests/distributed/test_callbacks.py)."""

import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
from models import fit_trainer

from lightning_gpipe import GPipeStrategy, PipelineBalance, PipelineThroughput, PipelineTimeline, solve
from lightning_gpipe.engine import StageTrace, StepTrace
from lightning_gpipe.engine.events import Span
from lightning_gpipe.lightning.callbacks.balance import format_table
from lightning_gpipe.planning.balance import LayerCost


def test_callbacks_warn_and_do_nothing_without_gpipe(tmp_path):
    callbacks = [PipelineBalance(warmup=0, steps=1), PipelineThroughput(), PipelineTimeline(steps=(0,))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer(max_steps=2, callbacks=callbacks, default_root_dir=str(tmp_path))
    messages = " ".join(str(w.message) for w in caught)
    for name in ("PipelineBalance", "PipelineThroughput", "PipelineTimeline"):
        assert f"{name} measures the stages of GPipeStrategy; under SingleDeviceStrategy it does nothing" in messages
    assert list(tmp_path.iterdir()) == [] and callbacks[0].report is None and callbacks[2].written == []
    assert isinstance(callbacks[1], L.Callback)


def _stage(stage: int, linears: int, micro_batches: int, loss: float = 0.0, waiting: float = 0.0) -> StageTrace:
    """One step of a stage of ``linears`` Linear(1024, 1024) and as many ReLUs, at 1 s per Linear's forward and 2 s per
    backward (ReLUs free), each span after the last: the forwards, the head and loss (``loss`` s), then the drain in
    reverse order, each micro-batch waiting ``waiting`` s for its gradient, recomputed (all but the last: checkpoint
    "except_last") and run backward. Whole seconds, so that every sum is exact."""
    spans: list[Span] = []

    def run(kind: str, micro_batch: int | None, seconds: float) -> None:
        start = spans[-1].end if spans else 0.0
        spans.append(Span(kind, micro_batch, start, start + seconds))

    for i in range(micro_batches):
        run("forward", i, 1.0 * linears)
    if loss:
        run("loss", None, loss)
    for i in reversed(range(micro_batches)):
        if waiting:
            run("recv", i, waiting)
        if i < micro_batches - 1:
            run("recompute", i, 1.0 * linears)
        run("backward", i, 2.0 * linears)
    return StageTrace(stage, spans, 0.0, spans[-1].end, layers=2 * linears, parameters=linears * (1024 * 1024 + 1024))


def _fed(tmp_path, strategy: GPipeStrategy, steps: list[StepTrace], callback: PipelineBalance, caplog) -> tuple:
    """Feed ``steps`` to ``callback`` as the strategy's gathered traces of the trainer's batches (a trainer as the
    callback reads it, at global step 7, with one logger): ``(what it logged, as (step, metrics) pairs, what it printed
    at INFO)``."""
    logged: list[tuple] = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer = SimpleNamespace(
        strategy=strategy, loggers=[logger], logger=None, default_root_dir=str(tmp_path), global_step=7
    )
    with caplog.at_level(logging.INFO):
        for step in steps:
            if callback.wants(step.step):
                callback.on_step(trainer, step)
    return logged, caplog.text


def _uneven_steps() -> list[StepTrace]:
    """Batches 0-7 of the distributed test's run (tests/workers/callbacks.py): balance=[2, 6], M=8, "except_last":
    stage 0 one Linear, stage 1 three, stage 0 waiting 1 s per micro-batch for its gradient; the head and loss take
    3, 4, 5, 4, 4 s over batches 2-6 (4 s on the mean), 100 s outside them (not measured)."""
    losses = [100.0, 100.0, 3.0, 4.0, 5.0, 4.0, 4.0, 100.0]
    return [StepTrace(b, [_stage(0, 1, 8, waiting=1.0), _stage(1, 3, 8, loss=loss)]) for b, loss in enumerate(losses)]


def test_pipeline_balance_reports_the_mean_stage_times_and_suggests_the_even_split(tmp_path, caplog):
    """One Linear against three, on the times :func:`_uneven_steps` gives: the report holds each stage's mean per
    step over the measured steps, the imbalance is the slowest stage's work (3 x 31 s + 4 s) over the mean (64 s),
    and on those times spread evenly over each stage's layers the even split [4, 4] is suggested, by the simulator
    1.39x as fast; it is logged, written and printed."""
    strategy = GPipeStrategy(balance=[2, 6], chunks=8, checkpoint="except_last")
    callback = PipelineBalance(warmup=2, steps=5)
    logged, printed = _fed(tmp_path, strategy, _uneven_steps(), callback, caplog)
    report = callback.report
    assert report is not None and report["steps"] == [2, 3, 4, 5, 6]
    assert (report["chunks"], report["checkpoint"], report["balance"]) == (8, "except_last", [2, 6])
    times = [(s["forward"], s["recompute"], s["backward"], s["loss"], s["waiting"]) for s in report["stages"]]
    assert times == [(8.0, 7.0, 16.0, 0.0, 8.0), (24.0, 21.0, 48.0, 4.0, 0.0)]  # waiting is no work
    assert report["imbalance"] == 97 / 64 and report["suggested_balance"] == report["best_balance"] == [4, 4]
    assert report["cost_source"] == "measured stage times"
    assert (report["predicted_step_s"], report["best_step_s"]) == (97.125, 70.0)
    assert report["speedup"] == 97.125 / 70.0
    ((step, metrics),) = logged
    assert step == 7 and metrics["pipeline/imbalance"] == 97 / 64 and metrics["pipeline/stage1/loss_s"] == 4.0
    assert metrics["pipeline/stage0/waiting_s"] == 8.0 and metrics["pipeline/stage1/backward_s"] == 48.0
    assert json.loads((tmp_path / "pipeline_balance.json").read_text()) == report
    table = format_table(report)
    assert table in printed and table.splitlines()[-2:] == [
        "imbalance (slowest stage's work over the mean): 1.52",
        "suggested balance=[4, 4] instead of [2, 6] (from measured stage times): simulated step 70s vs 97.12s,"
        " 1.39x as fast",
    ]


def test_pipeline_balance_suggests_nothing_within_its_threshold(tmp_path, caplog):
    """The same times with ``threshold=1.6``, above their imbalance of 1.52: no split is looked for or suggested, and
    the table ends with the imbalance."""
    strategy = GPipeStrategy(balance=[2, 6], chunks=8, checkpoint="except_last")
    callback = PipelineBalance(warmup=2, steps=5, threshold=1.6)
    _fed(tmp_path, strategy, _uneven_steps(), callback, caplog)
    report = callback.report
    assert report is not None and report["imbalance"] == 97 / 64 and report["suggested_balance"] is None
    assert "best_balance" not in report and "cost_source" not in report
    assert format_table(report).splitlines()[-1] == "imbalance (slowest stage's work over the mean): 1.52"


@pytest.mark.parametrize("balance, suggested", [([3, 1], None), ([1, 3], [3, 1])])
def test_pipeline_balance_suggests_only_a_split_the_simulator_predicts_faster_and_by_how_much(
    tmp_path, caplog, balance, suggested
):
    """On these profiled costs (which the strategy holds) the solver's even split, [2, 2], is slower on the simulator
    than [3, 1] (the first stage's recomputes hide in its waits for gradients): from [3, 1] nothing is suggested; from
    [1, 3] the fastest split the search finds, [3, 1], is, with its speed-up."""
    costs = [LayerCost(5.0, 1.0), LayerCost(2.0, 4.0), LayerCost(5.0, 1.0), LayerCost(5.0, 8.0)]
    assert solve([2 * c.forward + c.backward for c in costs], 2) == [2, 2]
    strategy = GPipeStrategy(balance=balance, chunks=2, checkpoint="always")
    strategy.layer_costs = costs
    stages = [  # two stages whose work differs threefold: above the threshold
        StageTrace(k, [Span("forward", i, 0.0, seconds) for i in range(2)], 0.0, 1.0, layers=n)
        for k, (n, seconds) in enumerate(zip(balance, (0.1, 0.3)))
    ]
    callback = PipelineBalance(warmup=0, steps=1)
    _fed(tmp_path, strategy, [StepTrace(0, stages)], callback, caplog)
    report = callback.report
    assert report is not None and report["suggested_balance"] == suggested and report["best_balance"] == [3, 1]
    table = format_table(report)
    if suggested is None:
        assert report["predicted_step_s"] == report["best_step_s"] == 66.0 and report["speedup"] == 1.0
        assert "suggested balance" not in table
        assert "no faster balance than [3, 1] found (from profiled layer costs; simulated step 66s;" in table
    else:
        assert report["predicted_step_s"] == 80.0
        assert table.splitlines()[-1] == (
            "suggested balance=[3, 1] instead of [1, 3] (from profiled layer costs): simulated step 66s vs 80s,"
            " 1.21x as fast"
        )
    assert json.loads((tmp_path / "pipeline_balance.json").read_text()) == report


def test_the_balance_table_docs_observability_md_shows_is_the_callbacks_format():
    """docs/observability.md's PipelineBalance output, its figures put back into a report, is what the table prints."""
    linear = 1024 * 1024 + 1024

    def stage(k, layers, forward, backward, loss, waiting, mib):
        return {
            "stage": k, "layers": layers, "parameters": layers // 2 * linear, "forward": forward, "recompute": 0.0,
            "backward": backward, "loss": loss, "waiting": waiting, "activation_bytes": mib * 2**20,
        }  # fmt: skip

    report = {
        "steps": [1, 2, 3],
        "chunks": 8,
        "checkpoint": "never",
        "balance": [4, 12],
        "stages": [stage(0, 4, 0.1222, 0.1704, 0.0, 0.5665, 12), stage(1, 12, 0.3156, 0.6796, 0.0079, 0.0517, 28)],
        "imbalance": 1.55,
        "suggested_balance": [8, 8],
        "cost_source": "profiled layer costs",
        "predicted_step_s": 0.6123,
        "best_balance": [8, 8],
        "best_step_s": 0.4398,
        "speedup": 0.6123 / 0.4398,
    }
    docs = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text(encoding="utf-8")
    block = docs.split("```\nPipeline balance, mean per step")[1].split("\n```")[0]
    assert "Pipeline balance, mean per step" + block == format_table(report)


def test_pipeline_balance_reports_the_profile_s_error_against_the_measured_stage_times(tmp_path, caplog):
    """With profiled layer costs (B and W too) under zb-h1, the report holds each stage's busy time per step the
    profile predicts (M times its forwards and backwards; the stage after the first runs B and W) against the measured
    forwards, backwards and weight gradients (the loss is not the backbone's), with the error, logged and in a line of
    the table."""
    whole = LayerCost(1e-3, 2e-3, input_grad=0.0, weight_grad=2e-3)  # the first layer's: on data, all W
    split = LayerCost(1e-3, 2e-3, input_grad=1e-3, weight_grad=1.5e-3)
    strategy = GPipeStrategy(balance=[2, 2], chunks=2, checkpoint="never", schedule="zb-h1")
    strategy.layer_costs = [whole, split] * 2  # predicted: 2 x (2 + 4) = 12 ms, 2 x (2 + 2 + 2.5) = 13 ms

    def spans(*kinds: tuple[str, float]) -> list[Span]:
        return [Span(kind, i, 0.0, seconds) for kind, seconds in kinds for i in range(2)]

    stages = [
        StageTrace(0, spans(("forward", 2e-3), ("backward", 4e-3)), 0.0, 1.0, layers=2),
        StageTrace(
            1, spans(("forward", 2.5e-3), ("loss", 1.0), ("backward", 3e-3), ("weight", 2e-3)), 0.0, 1.0, layers=2
        ),
    ]
    callback = PipelineBalance(warmup=0, steps=1, threshold=1e3)
    logged, printed = _fed(tmp_path, strategy, [StepTrace(0, stages)], callback, caplog)
    report = callback.report
    assert report is not None and report["profiled_s"] == pytest.approx([12e-3, 13e-3])
    assert report["measured_s"] == pytest.approx([12e-3, 15e-3])
    assert report["profile_error"] == pytest.approx([0.0, -2 / 15])
    ((_, metrics),) = logged
    assert metrics["pipeline/stage1/profile_error"] == pytest.approx(-2 / 15)
    line = "busy per step: profiled 12.0, 13.0 ms per step against 12.0, 15.0 ms measured, error +0%, -13%"
    assert format_table(report).splitlines()[-2] == line and line in printed
