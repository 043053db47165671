"""The schedule simulator against closed forms, and the instrumentation of the one-stage engine in-process."""

import pytest
import torch
from conftest import one_stage_pipeline
from torch import nn

from lightning_gpipe.engine.events import peak_activation_bytes
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.simulator import StageCost, Transfer, simulate, stage_costs


@pytest.mark.parametrize("stages, chunks", [(2, 8), (4, 4), (3, 1), (4, 16)])
def test_equal_stages_have_the_papers_bubble(stages, chunks):
    prediction = simulate([StageCost(forward=1.0, backward=2.0)] * stages, chunks, checkpoint="never")
    assert prediction.step_time == pytest.approx((chunks + stages - 1) * 3.0)
    assert prediction.bubble == pytest.approx((stages - 1) / (chunks + stages - 1))


def test_recompute_runs_while_waiting_for_the_gradient():
    # the last stage paces the drain at recompute + backward per micro-batch; the others recompute in its shadow
    f, b, stages, chunks = 1.0, 2.0, 3, 4
    prediction = simulate([StageCost(f, b)] * stages, chunks, checkpoint="always")
    assert prediction.step_time == pytest.approx((chunks + stages - 1) * f + chunks * (f + b) + (stages - 1) * b)
    first = prediction.trace.stages[0].spans
    recompute = next(s for s in first if s.kind == "recompute")
    wait = next(s for s in first if s.kind == "recv" and s.start >= recompute.end)
    assert wait.micro_batch == recompute.micro_batch == chunks - 1


@pytest.mark.parametrize(
    "checkpoint, expected",
    [("never", 4 * (10 + 100)), ("always", 4 * 10 + 100), ("except_last", 4 * 10 + 100)],
)
def test_peak_activation_memory_of_each_checkpoint_mode(checkpoint, expected):
    stage = StageCost(1.0, 2.0, input_bytes=10, activation_bytes=100)
    assert simulate([stage] * 2, 4, checkpoint).peak_activation_bytes == [expected, expected]


def test_transfers_and_the_loss_lengthen_the_critical_path():
    prediction = simulate(
        [StageCost(1.0, 2.0, output_bytes=1000)] * 2,
        micro_batches=1,
        checkpoint="never",
        transfer=Transfer(latency=0.5, bandwidth=2000),
        loss=0.25,
        optimizer=0.125,
    )
    assert prediction.step_time == pytest.approx(1.0 + 1.0 + 1.0 + 0.25 + 2.0 + 1.0 + 2.0 + 0.125)


def test_stage_costs_sum_layers_and_chain_boundary_bytes():
    costs = [LayerCost(1.0, 2.0, activation_bytes=5, output_bytes=7 * (i + 1)) for i in range(5)]
    first, second = stage_costs(costs, [2, 3], input_bytes=3)
    assert (first.forward, first.backward, first.activation_bytes) == (2.0, 4.0, 10)
    assert (first.input_bytes, first.output_bytes, second.input_bytes, second.output_bytes) == (3, 14, 14, 35)
    with pytest.raises(ValueError, match="does not split 5 layers"):
        stage_costs(costs, [2, 2])


def test_simulate_rejects_unknown_modes():
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        simulate([StageCost(1.0, 1.0)], 2, "sometimes")


WIDTH, ROWS, CHUNKS = 16, 12, 4


def _one_stage(checkpoint: str, enabled: bool) -> ModelChunk:
    """Run two training steps of Linear + ReLU through a one-stage engine, recording the second when ``enabled``.

    The first step is not the steady state the simulator predicts: its first micro-batch runs on a copy of its input,
    from which the stage learns whether its layers modify their input in place (``Partition.run``)."""
    module = nn.Module()
    module.backbone = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
    schedule = one_stage_pipeline(module, CHUNKS, checkpoint)
    for step in range(2):
        schedule.model_chunks[0].events.enabled = schedule.model_chunks[0].events.memory = enabled and step == 1
        module.backbone(torch.randn(ROWS, WIDTH)).sum().backward()
        schedule.backward()
    return schedule.model_chunks[0]


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_recorded_spans_and_memory_match_the_simulator(checkpoint):
    spans = _one_stage(checkpoint, enabled=True).events.take()
    kinds = [(s.kind, s.micro_batch) for s in spans if s.kind != "send"]
    recomputed = {"never": [], "always": [3, 2, 1, 0], "except_last": [2, 1, 0]}[checkpoint]
    assert [k for k in kinds if k[0] == "forward"] == [("forward", i) for i in range(CHUNKS)]
    assert [i for kind, i in kinds if kind == "recompute"] == recomputed
    assert [i for kind, i in kinds if kind == "backward"] == [3, 2, 1, 0]
    assert kinds[CHUNKS] == ("loss", None)
    # per micro-batch: the input (kept) and ReLU's output (saved); Linear's input and weight are not counted twice
    micro_bytes = ROWS // CHUNKS * WIDTH * 4
    expected = simulate(
        [StageCost(1.0, 1.0, input_bytes=micro_bytes, activation_bytes=micro_bytes)], CHUNKS, checkpoint
    )
    assert peak_activation_bytes(spans) == expected.peak_activation_bytes[0]


def test_disabled_recorder_records_nothing():
    assert _one_stage("except_last", enabled=False).events.take() == []


def test_a_prediction_exports_and_draws_like_a_measurement():
    from lightning_gpipe.lightning.callbacks import draw_timeline

    prediction = simulate([StageCost(1e-3, 2e-3)] * 2, 4, "except_last", loss=1e-3)
    events = [e for e in prediction.trace.to_chrome()["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in events if e["pid"] == 1} >= {"F0", "F3", "R2", "B0", "B3", "loss", "recv 0"}
    # stage 1 ends its drain before stage 0 does: idle until the step ends
    (idle,) = [e for e in events if e["tid"] == 2]
    assert (
        idle["pid"] == 1
        and idle["name"] == "idle"
        and idle["ts"] + idle["dur"] == pytest.approx(1e6 * prediction.step_time)
    )
    figure = draw_timeline(prediction.trace)
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["stage 0", "stage 1"]


def test_a_deferred_weight_gradient_shortens_the_step_by_one_weight_gradient():
    """F=1, B+W=3 with W=1, M=4: stage 0 starts its drain after stage 1's B (2), not its whole backward (3)."""
    plain = [StageCost(1.0, 3.0), StageCost(1.0, 3.0)]
    deferred = [StageCost(1.0, 3.0), StageCost(1.0, 3.0, weight=1.0)]  # the first stage sends nothing back
    assert simulate(plain, 4, "never").step_time == pytest.approx(20.0)  # (M + K - 1) (F + B + W)
    prediction = simulate(deferred, 4, "except_last")
    assert prediction.step_time == pytest.approx(19.0 + 3.0)  # and the 3 recomputes of stage 0
    kinds = [(s.kind, s.micro_batch) for s in prediction.trace.stages[1].spans if s.kind in ("backward", "weight")]
    assert kinds[:3] == [("backward", 3), ("weight", 3), ("backward", 2)]  # re-materialized: W follows its B


def test_the_last_stage_without_rematerialization_runs_every_weight_gradient_after_its_last_input_gradient():
    """A last stage of B=2, W=2 sends a gradient every 2 (not 4): stage 0 (B+W=3) never waits in its drain."""
    stages = [StageCost(1.0, 3.0), StageCost(1.0, 4.0, weight=2.0)]
    prediction = simulate(stages, 4, "never")
    kinds = [(s.kind, s.micro_batch) for s in prediction.trace.stages[1].spans if s.kind in ("backward", "weight")]
    assert kinds == [("backward", i) for i in (3, 2, 1, 0)] + [("weight", i) for i in (3, 2, 1, 0)]
    # stage 0: fill 4, first gradient at 7 (stage 1's F3 ends at 5, then B3), 4 backwards of 3: ends at 19;
    # stage 1: its 4 Ws run from 13 to 21. Each W after its B would end stage 0 at 22.
    ends = [max(s.end for s in trace.spans if s.kind != "optimizer") for trace in prediction.trace.stages]
    assert ends == [19.0, 21.0]
