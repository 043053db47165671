"""The pipeline callbacks on a real 2-stage run (one worker run for all three; without GPipeStrategy:
tests/unit/test_callbacks.py)."""

import csv
import json

import pytest
from conftest import shared_log, shared_run

TIMES = ("forward", "recompute", "backward", "loss", "waiting")
"""A PipelineBalance stage entry's seconds per step."""


TWO_STAGES = shared_run("callbacks.py", devices=2)


@pytest.fixture(scope="module")
def run():
    out = TWO_STAGES()
    return out, json.loads((out / "result.json").read_text()), shared_log(2)


def _metrics(out):
    with open(out / "csv/version_0/metrics.csv") as f:
        return list(csv.DictReader(f))


def test_timeline_writes_a_chrome_trace_of_every_stage(run):
    out, _, _ = run
    trace = json.loads((out / "csv/version_0/pipeline_timeline_step3.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1} and {e["tid"] for e in events} == {0, 1, 2}
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in events)
    for lane in {(e["pid"], e["tid"]) for e in events}:  # slices on one track must nest for Perfetto: no overlaps
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if (e["pid"], e["tid"]) == lane)
        assert all(end <= start + 1e-6 for (_, end), (start, _) in zip(spans, spans[1:]))
    for stage in (0, 1):
        names = {e["name"] for e in events if e["pid"] == stage}
        assert {f"F{i}" for i in range(8)} | {f"B{i}" for i in range(8)} | {f"R{i}" for i in range(7)} <= names
        assert "R7" not in names and "optimizer" in names and "idle" in names
    assert "loss" in {e["name"] for e in events if e["pid"] == 1}
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {(0, "stage 0"), (1, "stage 1")}
    # the fill: stage 1's first forward starts after stage 0's
    first = {stage: min(e["ts"] for e in events if e["pid"] == stage and e["name"] == "F0") for stage in (0, 1)}
    assert first[1] > first[0]


def test_timeline_chart_is_written_and_logged_to_tensorboard(run):
    out, result, _ = run
    png = out / "csv/version_0/pipeline_timeline_step3.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in result["written"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb/version_0")).Reload()
    assert "pipeline/timeline" in events.Tags()["images"]


def test_timeline_chart_is_saved_beside_every_loggers_files_and_as_an_mlflow_artifact(run):
    """The PNG also lands in the second logger's own log_dir, and an MLflow-like logger gets it as an artifact."""
    out, result, _ = run
    png = out / "tb/version_0/pipeline_timeline_step3.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in result["written"]
    assert result["artifacts"] == [["run0", str(out / "csv/version_0/pipeline_timeline_step3.png"), "pipeline"]]


def test_balance_reports_each_stage_in_the_shape_the_unit_tests_check(run):
    """The report of a real run, its shape only: the measured times, and so the imbalance and the split suggested, are
    the machine's (what the callback makes of given times: tests/unit/test_callbacks.py)."""
    out, result, output = run
    report = result["balance"]
    assert report == json.loads((out / "csv/version_0/pipeline_balance.json").read_text())
    assert report["balance"] == [2, 6] and report["steps"] == [2, 3, 4, 5, 6]
    assert (report["chunks"], report["checkpoint"]) == (8, "except_last")
    linear = 1024 * 1024 + 1024
    stages = [(s["stage"], s["layers"], s["parameters"]) for s in report["stages"]]
    assert stages == [(0, 2, linear), (1, 6, 3 * linear)]
    for stage in report["stages"]:
        assert set(stage) == {"stage", "layers", "parameters", *TIMES, "activation_bytes"}
        assert all(isinstance(stage[name], float) and stage[name] >= 0 for name in TIMES)
    assert report["stages"][0]["loss"] == 0  # the head and loss run on the last stage only
    # the inputs of 8 micro-batches of 128 x 1024 floats, plus one micro-batch's saved activations
    assert all(s["activation_bytes"] > 8 * 128 * 1024 * 4 for s in report["stages"])
    assert isinstance(report["imbalance"], float) and report["imbalance"] >= 1  # the slowest over the mean
    imbalance = [row["pipeline/imbalance"] for row in _metrics(out) if row["pipeline/imbalance"]]
    assert float(imbalance[0]) == pytest.approx(report["imbalance"])
    assert "Pipeline balance, mean per step over training steps 2-6 (M=8, checkpoint='except_last'):" in output
    assert f"imbalance (slowest stage's work over the mean): {report['imbalance']:.2f}" in output
    suggested = report["suggested_balance"]
    if "best_balance" not in report:  # within the threshold: nothing looked for
        assert suggested is None and report["imbalance"] <= 1.1
    elif suggested is None:
        assert f"no faster balance than [2, 6] found (from {report['cost_source']};" in output
    else:
        assert len(suggested) == 2 and min(suggested) >= 1 and sum(suggested) == 8 and suggested != [2, 6]
        assert f"suggested balance={suggested} instead of [2, 6] (from {report['cost_source']})" in output
    if "best_balance" in report:  # the default profiles the layers at fit start (its B/W split choice): those costs
        assert report["cost_source"] == "profiled layer costs"


def test_throughput_logs_samples_per_second_bubble_and_efficiency(run):
    out, result, _ = run
    rows = [row for row in _metrics(out) if row["pipeline/bubble"]]
    assert [int(row["step"]) for row in rows] == [2, 4, 6, 8]
    assert float(rows[-1]["throughput/device/samples_per_sec"]) > 0 and rows[-1]["throughput/samples"] == str(8 * 1024)
    for row in rows:
        efficiency = [float(row[f"pipeline/efficiency/stage{k}"]) for k in (0, 1)]
        assert 0 < min(efficiency) and max(efficiency) <= 1
        assert float(row["pipeline/bubble"]) == pytest.approx(1 - sum(efficiency) / 2)
        assert float(row["pipeline/bubble_ideal"]) == pytest.approx(1 / 9)  # K=2, M=8: (K-1)/(M+K-1)
    assert result["throughput"]["pipeline/bubble"] == pytest.approx(float(rows[-1]["pipeline/bubble"]))
