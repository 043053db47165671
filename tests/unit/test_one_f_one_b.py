"""GPipeStrategy(schedule="1f1b"): PipeDream-Flush's order, its memory bound, its contract, and one-device equality.

In-process: the schedule's order and in-flight micro-batches on fake stages that exchange messages in threads
(a send completes only once received, so a wrong order hangs), the one-stage engine against plain autograd,
deferred batch norm, the row splitting and row-weighted logging, the simulator. On stage processes:
tests/distributed/test_one_f_one_b.py.
"""

import threading
import weakref
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.actions import Kind
from lightning_gpipe.engine.batchnorm import convert_deferred_batch_norm
from lightning_gpipe.engine.events import Recorder
from lightning_gpipe.engine.model_chunk import ModelChunk
from lightning_gpipe.engine.partition import Split
from lightning_gpipe.engine.pipeline import Runtime
from lightning_gpipe.engine.schedule import one_f_one_b, plans
from lightning_gpipe.engine.transfer import Link
from lightning_gpipe.faults.job import Job
from lightning_gpipe.lightning.contract import BackboneCall
from lightning_gpipe.lightning.per_micro_batch import RowWeighted, batch_rows, check_input_rows, split_batch
from lightning_gpipe.planning.simulator import StageCost, action_costs, simulate

# --------------------------------------------------------------------------- the order, on fake stages


DEADLOCK = 60.0
"""Seconds a fake stage waits for a message before it calls the wait a deadlock: far beyond what a busy machine takes to
schedule the other threads (a run without a deadlock waits milliseconds)."""


class _Wire:
    """Messages between fake stages; a send completes only once its receive has run, or for a gradient once its
    receive is posted (as on gloo and NCCL; stricter than gloo, whose small sends complete at once)."""

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.sent: set = set()
        self.received: set = set()

    def post(self, message) -> None:
        with self.condition:
            self.received.add(message)
            self.condition.notify_all()

    def send(self, message) -> None:
        with self.condition:
            self.sent.add(message)
            self.condition.notify_all()

    def receive(self, message) -> None:
        with self.condition:
            assert self.condition.wait_for(lambda: message in self.sent, timeout=DEADLOCK), (
                f"deadlock: {message} never sent"
            )
            self.received.add(message)
            self.condition.notify_all()

    def wait_received(self, messages: set) -> None:
        with self.condition:
            assert self.condition.wait_for(lambda: messages <= self.received, timeout=DEADLOCK), "deadlock in a flush"


class _FakeChunk:
    """A model chunk's primitives as a schedule sees them, logging calls and counting micro-batches in flight."""

    def __init__(self, k: int, stages: int, micro_batches: int, wire: _Wire, defer: bool = False) -> None:
        self.virtual_stage, self.is_first, self.is_last = k, k == 0, k == stages - 1
        self.micro_batches, self.wire, self.events = micro_batches, wire, Recorder()
        self.checkpoint, self.defer_weight_grad, self.training, self.offload = "always", defer, True, None
        self.calls: list[tuple[str, int]] = []
        self.held: set[int] = set()
        self.peak = 0
        self.sends: set = set()

    def inputs(self, value):
        for i in range(self.micro_batches):
            if not self.is_first:
                self.wire.receive(("activation", self.virtual_stage - 1, i))
            yield i, None, self.micro_batches

    def forward(self, i, x, micro_batches):
        self.calls.append(("forward", i))
        self.held.add(i)
        self.peak = max(self.peak, len(self.held))

    def _send(self, message) -> None:
        self.wire.send(message)
        self.sends.add(message)

    def send(self, y, i):
        self.calls.append(("send", i))
        self._send(("activation", self.virtual_stage, i))

    def expect_grad(self, i):
        self.calls.append(("expect", i))
        if not self.is_last:
            self.wire.post(("gradient", self.virtual_stage + 1, i))

    def recompute(self, i):
        self.calls.append(("recompute", i))

    def backward(self, i):
        if not self.is_last:
            self.wire.receive(("gradient", self.virtual_stage + 1, i))
        self.calls.append(("backward", i))
        self.held.discard(i)
        if not self.is_first:
            self._send(("gradient", self.virtual_stage, i))

    def backward_weights(self, indices):
        self.calls.append(("weights", tuple(indices)))

    def loss(self, i, y, head):
        head(y)

    def flush(self):
        self.wire.wait_received(set(self.sends))

    def output(self, parts):  # fill-drain's last stage: the backbone output the user's loss takes
        return parts

    def begin_backward(self):
        return len(self.held)


def _run_processes(processes: list[list[_FakeChunk]], schedule: str, costs=None) -> None:
    """Run one step of ``schedule`` (placed by ``costs``) on each process's fake chunks, a thread per process; the
    last chunk of the last process logs the user's head. Raises what a thread raised (a deadlock: its wait's
    assertion)."""
    head, errors = processes[-1][-1], []

    def run(model_chunks: list[_FakeChunk]) -> None:
        try:
            runtime = Runtime(model_chunks, schedule, len(processes), costs=costs)
            if runtime.loss_per_micro_batch:
                runtime.forward(None, lambda i, micro_batches, y: head.calls.append(("head", i)))
            else:
                runtime.forward(None)
                runtime.backward()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(process,)) for process in processes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * DEADLOCK)  # a deadlocked wait raises within DEADLOCK
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads), "a fake stage never finished"


def _run_fake_pipeline(stages: int, micro_batches: int, schedule: str = "1f1b", costs=None) -> list[_FakeChunk]:
    wire = _Wire()
    fakes = [_FakeChunk(k, stages, micro_batches, wire, defer=schedule.startswith("zb")) for k in range(stages)]
    _run_processes([[fake] for fake in fakes], schedule, costs)
    return fakes


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (3, 5), (4, 8), (3, 2), (4, 1)])
def test_1f1b_order_holds_at_most_k_minus_k_micro_batches_and_never_deadlocks(stages, micro_batches):
    for fake in _run_fake_pipeline(stages, micro_batches):
        k, calls = fake.virtual_stage, fake.calls
        work = [c for c in calls if c[0] in ("forward", "recompute", "backward")]
        plan = one_f_one_b(k, stages, micro_batches, "always", False).actions
        predicted = [
            (a.kind.value, a.micro_batch) for a in plan if a.kind in (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD)
        ]
        assert work == predicted, k  # the simulator predicts this order
        assert fake.peak == min(stages - k, micro_batches)
        expects = [i for kind, i in calls if kind == "expect"]
        assert expects == ([] if fake.is_last else list(range(micro_batches)))  # in the order gradients are sent
        for i in range(micro_batches):
            assert calls.index(("forward", i)) < calls.index(("backward", i))
            if not fake.is_last:
                assert calls.index(("send", i)) < calls.index(("expect", i)) < calls.index(("backward", i))
            else:
                assert calls.index(("forward", i)) < calls.index(("head", i)) < calls.index(("backward", i))


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (3, 5), (4, 8), (4, 2)])
def test_zb_h1_never_deadlocks_and_runs_its_trailing_weight_gradients_in_one_call(stages, micro_batches):
    for fake in _run_fake_pipeline(stages, micro_batches, "zb-h1"):
        k, calls = fake.virtual_stage, fake.calls
        assert fake.peak == min(stages - k, micro_batches)  # micro-batches waiting for their B, as under 1F1B
        weights = [i for kind, i in calls if kind == "weights"]
        if k == 0:  # sends no input gradient: whole backwards, no W
            assert not weights
            continue
        # W of j after B of j + k, one call each; the W right after the last B and the k after it: one call
        alone = [(j,) for j in range(micro_batches - 1 - k)]
        assert weights == alone + [tuple(range(max(micro_batches - 1 - k, 0), micro_batches))]
        for i in range(micro_batches):
            assert calls.index(("backward", i)) < next(
                n for n, c in enumerate(calls) if c[0] == "weights" and i in c[1]
            )


def test_zb_1p_runs_each_w_where_the_costs_place_it():
    """Stage 1 of 3 waits for its gradients longer than a W takes: it runs the W between a recompute and the B that
    waits (ZB-H1 runs it after that B), and the runtime follows the placed plan, consecutive W in one call."""
    costs = action_costs(
        [StageCost(0.5, 1.5, weight=0.5), StageCost(0.5, 2.0, weight=1.0), StageCost(0.5, 2.5, weight=0.5)]
    )
    placed, fixed = plans("zb-1p", 3, 5, "always", True, 1, costs), plans("zb-h1", 3, 5, "always")
    assert placed[1] != fixed[1]
    for fake, plan in zip(_run_fake_pipeline(3, 5, "zb-1p", costs), placed):
        expected, kinds = [], {Kind.FORWARD: "forward", Kind.RECOMPUTE: "recompute", Kind.BACKWARD: "backward"}
        for action in plan.actions:
            if action.kind is Kind.WEIGHT:
                if expected and expected[-1][0] == "weights":
                    expected[-1] = ("weights", (*expected[-1][1], action.micro_batch))
                else:
                    expected.append(("weights", (action.micro_batch,)))
            elif action.kind in kinds:
                expected.append((kinds[action.kind], action.micro_batch))
        assert [c for c in fake.calls if c[0] in ("forward", "recompute", "backward", "weights")] == expected


# --------------------------------------------------------------------------- one stage, real engine


class _Net(nn.Module):
    """A LightningModule's shape without Lightning: a backbone, a head, ``training_step`` and ``log``."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)
        self.logged: list[tuple] = []

    def log(self, name, value, prog_bar=False, on_step=None, on_epoch=None, batch_size=None):
        self.logged.append((name, value, batch_size))

    def training_step(self, batch, batch_idx):
        x, y = batch["x"], batch["y"]
        loss = F.cross_entropy(self.head(self.backbone(x)), y)
        self.log("loss", loss, prog_bar=True)
        self.log("rows", float(len(x)), batch_size=len(x))
        return {"loss": loss, "rows_seen": y}


def _one_stage(net: nn.Module, micro_batches: int, checkpoint: str) -> BackboneCall:
    split = Split(net, "backbone", [len(net.backbone)], stage_index=0)
    stage = ModelChunk(
        split.partition, Link(None, None, torch.device("cpu"), job=Job()), 0, 1, micro_batches, checkpoint
    )
    call = BackboneCall(Runtime([stage], "1f1b", 1), is_last=True)
    split.partition.backbone_call = call
    return call


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_one_stage_1f1b_equals_plain_autograd_and_combines_by_rows(checkpoint):
    torch.manual_seed(0)
    batch = {"x": torch.randn(10, 4), "y": torch.randint(0, 3, (10,)), "note": "kept whole"}
    reference, net = _Net(), _Net()
    net.load_state_dict(reference.state_dict())
    reference.training_step(batch, 0)["loss"].backward()
    call = _one_stage(net, 4, checkpoint)
    output = call.micro_batch_steps(net, "training_step", (batch, 0), {}, lambda loss, last: loss.backward())
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    # 10 rows in 4 micro-batches: 3, 3, 2, 2; the step's output and logs are row-weighted means
    assert torch.equal(output["rows_seen"], batch["y"])  # tensors of rows are concatenated
    (loss, rows) = net.logged[-2:]
    torch.testing.assert_close(loss[1], output["loss"])
    assert rows == ("rows", pytest.approx((9 + 9 + 4 + 4) / 10), 10)


@pytest.mark.parametrize(
    "checkpoint, through", [("never", [1, 1, 1, 1]), ("except_last", [0, 0, 0, 1]), ("always", [0, 0, 0, 0])]
)
def test_1f1b_last_stage_backpropagates_a_kept_graph_from_the_loss_in_one_autograd_call(checkpoint, through):
    """A micro-batch that is not re-materialized reaches the stage's parameters in its loss's own backward; one that
    is gets them at its backward. Either way each micro-batch has one backward span, which a kept graph's loss span
    ends where it starts, and the last loss completes the stage's gradients only when it runs through."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(10, 4), "y": torch.randint(0, 3, (10,))}
    reference, net = _Net(), _Net()
    net.load_state_dict(reference.state_dict())
    reference.training_step(batch, 0)["loss"].backward()
    call = _one_stage(net, 4, checkpoint)
    chunk = call.pipeline.model_chunks[0]
    chunk.events.enabled = True
    reached, completes = [], []

    def backward(loss, last):
        before = next(net.backbone.parameters()).grad
        before = None if before is None else before.clone()
        completes.append(chunk.loss_completes_gradients)
        loss.backward()
        after = next(net.backbone.parameters()).grad
        reached.append(int(after is not None and (before is None or not torch.equal(before, after))))

    call.micro_batch_steps(net, "training_step", (batch, 0), {}, backward)
    assert reached == through and completes == [False, False, False, bool(through[-1])]
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=name)
    spans = chunk.events.take()
    for index in range(4):
        (loss,) = [s for s in spans if s.kind == "loss" and s.micro_batch == index]
        (backward_span,) = [s for s in spans if s.kind == "backward" and s.micro_batch == index]
        assert loss.start <= loss.end <= backward_span.start <= backward_span.end
        if through[index]:
            assert backward_span.start == loss.end < backward_span.end


def test_a_1f1b_step_swaps_in_the_stage_stream_once():
    """The step on the whole batch ends at the backbone call on every stage alike, so it stays on the shared stream;
    the plan (forwards, each micro-batch's step and backward) runs on the stage stream, swapped in once per step."""

    class Streams:
        swaps = depth = 0

        @contextmanager
        def stage(self):
            Streams.swaps += Streams.depth == 0
            Streams.depth += 1
            try:
                yield
            finally:
                Streams.depth -= 1

    torch.manual_seed(0)
    net, depths = _Net(), []
    step = net.training_step
    net.training_step = lambda batch, index: (depths.append(Streams.depth), step(batch, index))[1]
    call = _one_stage(net, 4, "never")
    call.randomness = Streams()
    batch = {"x": torch.randn(10, 4), "y": torch.randint(0, 3, (10,))}
    call.micro_batch_steps(net, "training_step", (batch, 0), {}, lambda loss, last: loss.backward())
    assert Streams.swaps == 1 and depths == [0, 1, 1, 1, 1]


def test_1f1b_errors_name_the_fix_before_any_micro_batch():
    with pytest.raises(ValueError, match=r"needs the batch's rows in dim 0; got shapes \[\(10, 4\), \(3,\)\]"):
        batch_rows((torch.zeros(10, 4), torch.zeros(3)))
    with pytest.raises(TypeError, match="holds no tensor"):
        batch_rows({"text": ["a", "b"]})
    with pytest.raises(ValueError, match="the batch has 10 rows and the backbone input 20"):
        check_input_rows(torch.zeros(20, 4), 10)
    net = _Net()
    call = _one_stage(net, 4, "never")
    net.training_step = lambda batch, batch_idx: net.head(net.backbone(batch["x"][:, :4].repeat(2, 1))).sum()
    with pytest.raises(ValueError, match="the batch has 10 rows and the backbone input 20"):
        call.micro_batch_steps(net, "training_step", ({"x": torch.zeros(10, 4)}, 0), {}, print)
    with pytest.raises(ValueError, match="GPipeStrategy\\(schedule='2f2b'\\)"):
        GPipeStrategy(schedule="2f2b")


def test_split_batch_splits_every_tensor_like_tensor_split():
    batch = {"x": torch.arange(10), "pair": (torch.arange(20).reshape(10, 2), "tag")}
    parts = split_batch(batch, 4)
    assert [len(p["x"]) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([p["pair"][0] for p in parts]), batch["pair"][0])
    assert all(p["pair"][1] == "tag" for p in parts)


def test_row_weighted_logs_the_mean_a_device_logs():
    class Metric:  # stands for a torchmetrics Metric: logged as the object
        pass

    net, metric = _Net(), Metric()
    results = RowWeighted(net, rows=10)
    results.run(0, lambda: net.log("dropped", 1.0))  # the step on the whole batch, up to its backbone call

    def step(value: float) -> float:
        net.log("mean", torch.tensor(value))
        net.log("acc", metric)
        return value

    for rows, value in ((6, 1.0), (4, 2.0)):
        results.run(rows, lambda value=value: step(value))
    assert results.finish() == pytest.approx(1.4)
    assert [(name, float(v) if name == "mean" else v) for name, v, _ in net.logged] == [
        ("mean", pytest.approx(1.4)),
        ("acc", metric),
    ]


def test_row_weighted_keeps_no_micro_batchs_loss_graph_past_its_step():
    """A micro-batch's loss kept with its graph would keep the micro-batch's output (a boundary leaf) and its gradient
    alive until the whole step ends: the last stage under 1F1B would hold every re-materialized micro-batch's."""
    results, outputs = RowWeighted(_Net(), rows=4), []

    def step() -> dict:
        output = torch.ones(2, 3, requires_grad=True)  # the micro-batch's output, as the boundary gives it
        outputs.append(weakref.ref(output))
        return {"loss": (2 * output).sum()}

    returned = results.run(2, step)
    returned["loss"].backward()
    del returned
    assert outputs[0]() is None
    assert results.finish()["loss"] == 12


def test_deferred_batch_norm_counts_each_micro_batch_once_under_1f1b():
    torch.manual_seed(0)
    x = 3.0 + 2.0 * torch.randn(12, 4)
    plain, net = nn.BatchNorm1d(4), _Net()
    net.backbone = convert_deferred_batch_norm(nn.Sequential(nn.BatchNorm1d(4)))
    net.head = nn.Linear(4, 3)
    call = _one_stage(net, 3, "always")  # recomputes must not count again
    net.training_step = lambda batch, batch_idx: net.head(net.backbone(batch)).sum()
    call.micro_batch_steps(net, "training_step", (x, 0), {}, lambda loss, last: loss.backward())
    plain(x)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(net.backbone.get_submodule("0"), name), getattr(plain, name), msg=name)


# --------------------------------------------------------------------------- the simulator


@pytest.mark.parametrize("stages, micro_batches", [(2, 8), (4, 4), (3, 2), (4, 16)])
def test_simulated_1f1b_has_fill_drains_time_and_k_minus_k_memory(stages, micro_batches):
    cost = StageCost(1.0, 2.0, input_bytes=10, activation_bytes=100)
    for checkpoint in ("never", "always", "except_last"):
        gpipe = simulate([cost] * stages, micro_batches, checkpoint, loss=0.5)
        one = simulate([cost] * stages, micro_batches, checkpoint, loss=0.5, schedule="1f1b")
        assert one.step_time <= gpipe.step_time + 1e-9
        held = [min(stages - k, micro_batches) for k in range(stages)]
        expected = {
            "never": [h * 110 for h in held],
            "always": [h * 10 + 100 for h in held],
            "except_last": [h * 10 + min(h, 2) * 100 for h in held],
        }[checkpoint]
        assert one.peak_activation_bytes == expected, checkpoint
    plain = simulate([StageCost(1.0, 2.0)] * stages, micro_batches, "never", schedule="1f1b")
    assert plain.step_time == pytest.approx((micro_batches + stages - 1) * 3.0)


def test_a_1f1b_prediction_draws_loss_per_micro_batch():
    from lightning_gpipe.lightning.callbacks import draw_timeline

    prediction = simulate([StageCost(1e-3, 2e-3)] * 3, 4, "never", loss=4e-4, schedule="1f1b")
    events = prediction.trace.to_chrome()["traceEvents"]
    names = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == 2 and e["tid"] == 0]
    assert names[:4] == ["F0", "loss 0", "B0", "F1"]
    assert [label.get_text() for label in draw_timeline(prediction.trace).axes[0].get_yticklabels()] == [
        "stage 0",
        "stage 1",
        "stage 2",
    ]


# --------------------------------------------------------------------------- interleaved, on fake stages


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages, virtual, micro_batches", [(2, 2, 4), (3, 2, 5), (2, 3, 3), (4, 2, 2)])
def test_interleaved_runtime_runs_each_chunk_in_its_plans_order_without_deadlock(
    schedule, stages, virtual, micro_batches
):
    wire, micro_batches = _Wire(), stages * virtual
    processes = [
        [_FakeChunk(c * stages + k, micro_batches, micro_batches, wire) for c in range(virtual)] for k in range(stages)
    ]
    _run_processes(processes, schedule)
    for k, process in enumerate(processes):
        plan = Runtime(process, schedule, stages).plan(micro_batches).actions
        for c, fake in enumerate(process):
            work = [call for call in fake.calls if call[0] in ("forward", "recompute", "backward")]
            planned = [
                (a.kind.value, a.micro_batch)
                for a in plan
                if a.model_chunk == c and a.kind in (Kind.FORWARD, Kind.RECOMPUTE, Kind.BACKWARD)
            ]
            assert work == planned, (k, c)
            assert sorted(i for kind, i in work if kind == "backward") == list(range(micro_batches))
