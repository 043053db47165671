"""The planner on synthetic layer costs, plan() on a small module, and plan="auto" on one stage."""

import dataclasses
import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_gpipe import GPipeStrategy, plan
from lightning_gpipe.engine import actions, schedule
from lightning_gpipe.lightning.config import PipelineConfig
from lightning_gpipe.lightning.planner import plan_for_strategy
from lightning_gpipe.planning import (
    Constraints,
    CostModel,
    PipelinePlan,
    ProfiledCosts,
    optimizer_state_factor,
    predict,
    search,
)
from lightning_gpipe.planning.balance import LayerCost, profile_layers
from lightning_gpipe.planning.costs import HeadCost
from lightning_gpipe.planning.held import held_levels, held_peak
from lightning_gpipe.planning.predict import modelled_stage_costs
from lightning_gpipe.planning.search import meshes
from lightning_gpipe.planning.simulator import simulate

MIB = 2**20
FREE = CostModel(0.0, float("inf"), 0.0, 0.0, float("inf"), float("inf"), 0.0, copy_bandwidth=float("inf"))
"""Only the layers cost anything."""


def mlp_costs(pairs: int, rows: int, width: int = 256, fixed: float = 0.0) -> list[LayerCost]:
    """(Linear, ReLU) pairs at ``rows`` rows: the Linear saves its input, the ReLU its output (one storage with the
    next Linear's input); ``fixed`` seconds per layer whatever the rows."""
    row = 4 * width * rows
    linear = LayerCost(fixed + 1e-6 * rows, fixed + 2e-6 * rows, row, row, 4 * width * width, row, 0)
    relu = LayerCost(fixed + 1e-8 * rows, fixed + 1e-8 * rows, row, row, 0, 0, row)
    return [linear, relu] * pairs


def profiled(pairs: int = 4, rows: int = 64, small: int = 1, fixed: float = 0.0) -> ProfiledCosts:
    return ProfiledCosts(
        (rows, small), mlp_costs(pairs, rows, fixed=fixed), mlp_costs(pairs, small, fixed=fixed), rows, 4 * 256 * rows
    )


def test_costs_are_affine_in_rows_between_the_profiled_sizes_and_bytes_proportional():
    costs = profiled(rows=64, small=4, fixed=1e-3)
    at16 = costs.at(16)[0]
    assert at16.forward == pytest.approx(1e-3 + 1e-6 * 16)
    assert at16.activation_bytes == 4 * 256 * 16
    assert at16.parameter_bytes == 4 * 256 * 256
    first = costs.for_micro_batches(3)[0]  # the first of tensor_split's micro-batches: 22 rows
    assert first.activation_bytes == 4 * 256 * 22


def test_a_time_that_falls_with_the_rows_is_scaled_never_extrapolated_below_zero():
    noisy = LayerCost(forward=1e-3, backward=1e-3)
    costs = ProfiledCosts((64, 8), [noisy], [LayerCost(forward=2e-3, backward=2e-3)], 512, 4 * 512)
    assert costs.at(512)[0].forward == pytest.approx(8e-3)  # 1 ms at 64 rows, scaled to 512


@pytest.mark.parametrize(
    "optimizer, factor",
    [
        (lambda p: torch.optim.SGD(p, lr=0.1), 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1),
        (lambda p: torch.optim.Adam(p), 2),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), 3),
        (lambda p: "momentum", 1),
    ],
)
def test_optimizer_state_factor(optimizer, factor):
    assert optimizer_state_factor(optimizer([nn.Parameter(torch.zeros(2))])) == factor


def test_a_storage_two_layers_save_counts_once_and_the_kept_input_is_not_saved_twice():
    layers = mlp_costs(2, rows=8)
    stages = modelled_stage_costs(layers, [2, 2], FREE)
    row = 4 * 256 * 8
    assert [s.activation_bytes for s in stages] == [row, row]  # Linear's input is the kept input; ReLU's output
    assert stages[0].input_bytes == 0 and stages[1].input_bytes == row  # the first stage's input is the batch's view


def test_memory_is_parameters_gradients_optimizer_activations_and_buffers():
    costs = profiled()
    p = PipelinePlan(2, 1, 4, "never", "gpipe", (4, 4))
    prediction = predict(p, costs, FREE, state_factor=1, limit=2**40)
    params = 2 * 4 * 256 * 256
    layers = costs.for_micro_batches(4)
    peaks = simulate(modelled_stage_costs(layers, [4, 4], FREE), 4, "never").peak_activation_bytes
    for stage, peak in zip(prediction.memory, peaks):
        assert (stage.parameters, stage.gradients, stage.optimizer, stage.activations) == (params, params, params, peak)
    replicated = predict(PipelinePlan(2, 2, 4, "never", "gpipe", (4, 4)), costs, FREE, 1, 2**40)
    assert [s.buffers - r.buffers for s, r in zip(replicated.memory, prediction.memory)] == [params, params]  # DDP


class Widen(nn.Module):
    """A layer whose forward makes an intermediate no operation saves: ``x`` repeated ``times`` along dim 1, then
    summed back (sum saves nothing), so the intermediate is freed before the forward ends: a transient."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def forward(self, x):
        return x * x.repeat(1, self.times).sum(1, keepdim=True)


def test_a_layers_transient_is_profiled_and_the_stages_largest_is_added_on_top():
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    layers = nn.Sequential(nn.Linear(64, 64), Widen(8), nn.Linear(64, 64), Widen(2))
    costs = profile_layers(layers, x, repeats=1, warmup=0)
    assert costs[1].transient_bytes > costs[3].transient_bytes > costs[0].transient_bytes  # grows with the repeats
    assert costs[1].transient_bytes > 4 * x.nbytes  # most of the 8 x.nbytes repeated, alive only inside the forward
    profiled_costs = ProfiledCosts((32, 32), costs, costs, 64, 2 * x.nbytes)
    prediction = predict(PipelinePlan(2, 1, 2, "never", "gpipe", (2, 2)), profiled_costs, FREE, 0, 2**40)
    layers_at = profiled_costs.for_micro_batches(2)
    for k, stage in enumerate(prediction.memory):
        first, second = layers_at[2 * k : 2 * k + 2]  # the gradient between them lives in either's backward
        freed = second.activation_bytes - second.input_saved_bytes  # before the first's backward, after its forward
        in_first, in_second = first.transient_bytes - freed, second.transient_bytes  # a peak, no sum
        assert stage.transient == max(in_first, in_second) + first.output_bytes > first.output_bytes
    without = [dataclasses.replace(c, transient_bytes=0) for c in costs]
    plain = predict(prediction.plan, ProfiledCosts((32, 32), without, without, 64, 2 * x.nbytes), FREE, 0, 2**40)
    assert [s.total - p.total for s, p in zip(prediction.memory, plain.memory)] == [
        s.transient - p.transient for s, p in zip(prediction.memory, plain.memory)
    ]


def test_a_transient_is_affine_in_the_rows_as_a_weights_gradient_in_it_does_not_grow_with_them():
    fixed, per_row = 1000, 10
    big, small = (LayerCost(0.0, 0.0, transient_bytes=fixed + per_row * rows) for rows in (64, 8))
    costs = ProfiledCosts((64, 8), [big], [small], 512, 4 * 512)
    assert [costs.at(rows)[0].transient_bytes for rows in (8, 32, 512)] == [fixed + per_row * r for r in (8, 32, 512)]


def test_the_loss_costs_are_measured_where_planned_and_a_straight_line_between():
    head = HeadCost((8, 64), (800, 6400), parameter_bytes=12)
    assert [head.at(rows) for rows in (8, 36, 64, 128, 4)] == [800, 3600, 6400, 12800, 400]


VOCABULARY = 4096


class BigVocabulary(pl.LightningModule):
    """A backbone of small layers whose last makes logits over a large vocabulary, as the translation example's: the
    loss (log-probabilities, then their gradient) holds twice the logits, more than the layers keep. With
    ``needs_trainer`` its step reads the Trainer's optimizers after the loss, as the example logs its learning rate;
    with ``head``, a module after the backbone (a norm with running statistics, a projection) makes the logits."""

    def __init__(self, needs_trainer: bool = False, head: bool = False) -> None:
        super().__init__()
        width = 16 if head else VOCABULARY
        self.backbone = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, width))
        self.head = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, VOCABULARY)) if head else None
        self.needs_trainer = needs_trainer

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.backbone(x)
        loss = nn.functional.cross_entropy(self.head(out) if self.head is not None else out, y)
        self.log("train_loss", loss)
        if self.needs_trainer:
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _vocabulary_batch(rows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 16), torch.randint(0, VOCABULARY, (rows,))


@pytest.mark.parametrize("needs_trainer", [False, True])
def test_the_last_stage_counts_the_loss_on_the_batch_under_fill_drain_and_on_a_micro_batch_under_1f1b(needs_trainer):
    """The loss's tensors, twice the logits, are on the last stage's total: the whole batch's once under fill-drain,
    one micro-batch's under 1F1B (its step runs per micro-batch). A step that needs a running Trainer after the loss
    (not there when planning) is measured all the same."""
    fixed = {"pipeline_parallel_size": 2, "chunks": 4, "checkpoint": "never"}
    logits = 64 * VOCABULARY * 4
    memory = {}
    for name in ("gpipe", "1f1b"):
        report = plan(BigVocabulary(needs_trainer), 2, 2**40, example_batch=_vocabulary_batch(), schedule=name, **fixed)
        memory[name] = report.chosen.memory
    assert memory["gpipe"][1].loss == pytest.approx(2 * logits, rel=0.05) and memory["gpipe"][0].loss == 0
    assert memory["1f1b"][1].loss == pytest.approx(2 * logits / 4, rel=0.05)
    for stages in memory.values():
        last = stages[1]
        assert last.total - dataclasses.replace(last, loss=0).total == last.loss - last.transient > 0


def test_the_loss_is_profiled_at_every_micro_batch_size_the_planner_tries():
    head = plan(BigVocabulary(), 2, 2**40, example_batch=_vocabulary_batch()).profiled.head
    assert head is not None and head.rows == (1, 2, 4, 8, 16, 32, 64)  # 64 rows in 64, 32, ... 1 micro-batches
    assert head.peak_bytes[-1] == pytest.approx(2 * 64 * VOCABULARY * 4, rel=0.05)


def test_the_modules_after_the_backbone_are_counted_on_the_last_stage_and_left_as_they_were():
    module = BigVocabulary(head=True)
    state = {name: t.clone() for name, t in module.head.state_dict().items()}
    report = plan(
        module, 2, 2**40, example_batch=_vocabulary_batch(), backbone="backbone", pipeline_parallel_size=2, chunks=2
    )
    head = report.profiled.head
    assert head is not None and head.parameter_bytes == sum(t.nbytes for t in module.head.state_dict().values())
    layers, first = report.profiled.for_micro_batches(2), report.chosen.plan.balance[0]
    assert report.chosen.memory[1].parameters == sum(c.parameter_bytes for c in layers[first:]) + head.parameter_bytes
    assert head.peak_bytes[-1] >= 2 * 64 * VOCABULARY * 4  # the head's logits too
    assert all(torch.equal(t, state[name]) for name, t in module.head.state_dict().items())  # running statistics
    assert all(p.grad is None for p in module.parameters())


def test_under_1f1b_the_last_stage_holds_one_micro_batchs_output_gradient_not_the_batchs():
    costs = profiled()
    fill, one = (predict(PipelinePlan(2, 1, 4, "never", s, (4, 4)), costs, FREE, 0, 2**40) for s in ("gpipe", "1f1b"))
    batches, joined = 2 * costs.input_bytes, costs.at(64)[-1].output_bytes
    micro = costs.for_micro_batches(4)[-1].output_bytes
    assert (fill.memory[1].buffers, one.memory[1].buffers) == (batches + 2 * joined, batches + micro)


@pytest.mark.parametrize("micro_batches", [4, 8])
def test_a_sent_output_is_held_until_the_next_send_not_through_the_drain(micro_batches):
    """Checkpointed micro-batches keep no output in autograd; their sends hold them until the stage's next send or
    flush: the first stage of a fill-drain step holds one output on top of the activations (the last micro-batch's,
    which no later send releases before the flush: the first stage sends no gradient), whatever M, as under 1F1B.
    Beside it, the buffers its outputs' gradients are received into, from their receive's posting to their backward:
    all M from the drain's start under fill-drain, the K = 2 micro-batches in flight under 1F1B."""
    costs = profiled()
    out = costs.for_micro_batches(micro_batches)[3].output_bytes
    fill_drain = predict(PipelinePlan(2, 1, micro_batches, "always", "gpipe", (4, 4)), costs, FREE, 0, 2**40)
    m = micro_batches
    assert fill_drain.memory[0].transfers == out + m * out  # the ReLU saves its output: the recomputed one counts
    one_f_one_b = predict(PipelinePlan(2, 1, micro_batches, "always", "1f1b", (4, 4)), costs, FREE, 0, 2**40)
    assert one_f_one_b.memory[0].transfers == out + 2 * out


def _actions(text: str) -> list[actions.Action]:
    """A plan written as in the docs (``"F0 S0 B0 flush"``)."""
    kinds = {"F": actions.Kind.FORWARD, "S": actions.Kind.SEND, "E": actions.Kind.EXPECT}
    kinds.update({"R": actions.Kind.RECOMPUTE, "B": actions.Kind.BACKWARD, "L": actions.Kind.LOSS})
    return [
        actions.Action(actions.Kind.FLUSH) if word == "flush" else actions.Action(kinds[word[0]], int(word[1:]))
        for word in text.split()
    ]


def test_the_last_stage_holds_a_re_materialized_output_the_loss_took_until_its_backward_beside_the_recomputed_one():
    """Bytes per micro-batch: kept input 1, activations 100, output 10. Under 1F1B with ``"always"`` the last stage's
    loss takes the fill's output, kept until the backward while the recompute makes another; what the stage holds at
    a loss (inputs, that output) is far below its peak (the recomputed activations), which the loss's tensors are not
    added to; without re-materialization the loss runs at the peak."""
    one_f = "F0 L0 R0 B0 F1 L1 R1 B1 flush"
    assert held_levels(_actions(one_f), False, "always", 2, (1, 100, 10, 0)) == (122, 12)  # input grad 1 + 1 + 10
    assert held_levels(_actions("F0 L0 B0 F1 L1 B1 flush"), False, "never", 2, (1, 100, 10, 0)) == (112, 112)


def test_a_send_is_released_at_the_stages_next_send_or_flush():
    """Output bytes only (10 per micro-batch): a checkpointed output lives from its forward until the send after its
    own, so two at a time in the fill, and the last one until the flush; a recomputed output is another tensor; an
    output gradient's buffer lives from its receive's posting to its backward."""
    plan = schedule.plans("gpipe", 2, 4, "always")[0].actions  # F0 S0 F1 S1 F2 S2 F3 S3 E3 E2 E1 E0 R3 B3 ... flush
    assert held_peak(plan, True, "always", 4, (0, 0, 10, 0)) == 60  # S3's, the 4 buffers, R3's
    assert held_peak(_actions("F0 S0 F1 S1 F2 S2 flush"), True, "always", 3, (0, 0, 10, 0)) == 20
    assert held_peak(_actions("F0 S0 F1 F2 S1 S2 flush"), True, "always", 3, (0, 0, 10, 0)) == 30  # S1 frees only 0
    assert held_peak(_actions("F0 S0 F1 S1 E1 R1 B1 flush"), True, "always", 2, (0, 0, 10, 0)) == 30  # S1's, E1, R1's


def test_an_output_its_record_holds_is_freed_by_the_record_not_by_the_send():
    """Without re-materialization a sent output is its record's too: releasing the send frees nothing; the backward
    frees it (M outputs at the end of the fill, as before, and the M buffers of their gradients from the drain's
    start)."""
    plan = schedule.plans("gpipe", 2, 4, "never")[0].actions
    assert held_peak(plan, True, "never", 4, (0, 0, 10, 0)) == 80
    assert held_peak(_actions("F0 S0 F1 S1 B1 B0 F2 S2 flush"), True, "never", 3, (0, 0, 10, 0)) == 20


def test_an_input_gradient_is_released_at_the_next_send_or_flush():
    """Input and its gradient 10 bytes each, on a stage that sends no output: a micro-batch's gradient is pending
    until the next backward's send, so at most one beside the next micro-batch's input and the buffer of the one
    after it, whose receive taking that input posts (a flush frees the gradient too)."""
    one_at_a_time = _actions("F0 B0 F1 B1 F2 B2 flush")
    assert held_peak(one_at_a_time, False, "never", 3, (10, 0, 0, 0)) == 30
    assert held_peak(_actions("F0 B0 flush F1 B1 flush F2 B2 flush"), False, "never", 3, (10, 0, 0, 0)) == 20


def test_the_chosen_plan_is_the_fastest_that_fits_and_no_faster_one_fits():
    costs = profiled(pairs=8, rows=256, small=4, fixed=2e-4)
    whole = Constraints(sharding_strategy="NO_SHARD")  # sharded, the fastest plan would fit at the same time
    unlimited = search(2, costs, 2**40, 1, FREE, whole).chosen
    limit = unlimited.peak_bytes - 1  # the fastest plan no longer fits
    report = search(2, costs, limit, 1, FREE, whole)
    chosen = report.chosen
    assert chosen.fits and chosen.peak_bytes <= limit
    faster = [p for p in report.predictions if p.seconds_per_row < chosen.seconds_per_row]
    assert faster and not any(p.fits for p in faster)


@pytest.mark.parametrize("limit_mib", [4.5, 5.5, 6.5, 7.5])
def test_a_candidate_some_split_fits_is_not_refused(limit_mib):
    """Every split of every two-stage candidate predicted by brute force: where one fits, the planner has one too."""
    costs = dataclasses.replace(profiled(pairs=8, rows=256, small=4), large=_wide_outputs(profiled(8, 256).large))
    limit = limit_mib * MIB
    found = search(2, costs, 2**40, 1, FREE, Constraints(pipeline_parallel_size=2, virtual_stages=1)).predictions
    planned = {(p.plan.micro_batches, p.plan.checkpoint, p.plan.schedule) for p in found}
    chosen = {}
    for m, mode, name in planned:
        shape = Constraints(2, 1, m, mode, name, virtual_stages=1)
        chosen[m, mode, name] = any(p.fits for p in _predictions_or_none(costs, limit, shape))
    every = {
        (m, mode, name): any(
            predict(PipelinePlan(2, 1, m, mode, name, (j, 16 - j)), costs, FREE, 1, limit).fits for j in range(1, 16)
        )
        for m, mode, name in planned
    }
    assert any(every.values()) and chosen == every


def _wide_outputs(layers: list[LayerCost]) -> list[LayerCost]:
    """The first half's outputs four times as large: a split's boundary buffers, which the additive memory does not
    see, then decide whether it fits."""
    half = len(layers) // 2
    return [dataclasses.replace(c, output_bytes=4 * c.output_bytes) if j < half else c for j, c in enumerate(layers)]


def _predictions_or_none(costs: ProfiledCosts, limit: float, constraints: Constraints) -> list:
    try:
        return search(2, costs, limit, 1, FREE, constraints).predictions
    except ValueError:  # nothing fits
        return []


def test_no_plan_fits_names_the_smallest_limit_that_does():
    costs = profiled()
    with pytest.raises(ValueError, match="smallest limit that fits is") as error:
        search(2, costs, 1000, 2, FREE)
    smallest = int(str(error.value).split("smallest limit that fits is ")[1].split(" bytes")[0].replace(",", ""))
    assert search(2, costs, smallest + 1, 2, FREE).chosen.fits
    with pytest.raises(ValueError, match="No pipeline plan fits"):
        search(2, costs, smallest - 2, 2, FREE)


def test_constraints_are_kept():
    costs = profiled()
    kept = Constraints(micro_batches=4, checkpoint="always", schedule="1f1b", balance=[3, 5])
    report = search(2, costs, 2**40, 0, FREE, kept)
    assert {(p.plan.micro_batches, p.plan.checkpoint, p.plan.schedule, p.plan.balance) for p in report.predictions} == {
        (4, "always", "1f1b", (3, 5))
    }


def test_meshes_divide_the_world_and_conflicting_constraints_are_an_error():
    assert meshes(4, 8, Constraints()) == [(1, 4), (2, 2), (4, 1)]
    assert meshes(4, 2, Constraints()) == [(1, 4), (2, 2)]  # a stage needs a layer
    with pytest.raises(ValueError, match="No mesh of 4 processes"):
        meshes(4, 8, Constraints(pipeline_parallel_size=2, data_parallel_size=1))
    with pytest.raises(ValueError, match="balance"):
        meshes(4, 8, Constraints(balance=[1, 1, 6]))


def test_every_schedule_of_SCHEDULES_with_whole_backwards_is_planned(monkeypatch):
    monkeypatch.setitem(schedule.SCHEDULES, "gpipe-again", schedule.gpipe)
    monkeypatch.setitem(schedule.DEFERRED_BY_DEFAULT, "gpipe-again", False)
    report = search(2, profiled(), 2**40, 0, FREE)
    assert {p.plan.schedule for p in report.predictions} == {"gpipe", "1f1b", "gpipe-again"}


@pytest.mark.parametrize("name", ["zb-h1", "zb-1p"])
def test_a_schedule_that_needs_the_weight_split_is_planned_where_b_and_w_were_profiled(name):
    """The planner considers the schedules that split their backwards where the profile measured B and W (and needs
    it for them, named or not); named, zb-1p is predicted on its own placement, never slower than zb-h1's."""
    report = search(2, split_profiled(), 2**40, 0, FREE, Constraints(schedule=name))
    assert {p.plan.schedule for p in report.predictions} == {name}
    fixed = Constraints(pipeline_parallel_size=2, micro_batches=4)
    assert name in {p.plan.schedule for p in search(2, split_profiled(), 2**40, 0, FREE, fixed).predictions}
    assert name not in {p.plan.schedule for p in search(2, profiled(), 2**40, 0, FREE, fixed).predictions}
    assert Constraints().splits and Constraints(schedule=name).splits and not Constraints(schedule="1f1b").splits
    if name == "zb-1p":
        fixed = search(2, split_profiled(), 2**40, 0, FREE, Constraints(schedule="zb-h1"))
        assert report.chosen.step_time <= fixed.chosen.step_time * (1 + 1e-9)


def split_profiled(pairs: int = 4, rows: int = 64) -> ProfiledCosts:
    """:func:`profiled` with each Linear's backward split into B and W (as ``profile_layers(split=True)``): W a
    third more than half the backward, and B keeping the Linear's output gradient for W."""

    def split(costs: list[LayerCost]) -> list[LayerCost]:
        return [
            dataclasses.replace(
                c, input_grad=c.backward / 2, weight_grad=c.backward * 2 / 3, kept_grad_bytes=c.output_bytes
            )
            if c.parameter_bytes
            else dataclasses.replace(c, input_grad=c.backward)
            for c in costs
        ]

    costs = profiled(pairs, rows)
    return dataclasses.replace(costs, large=split(list(costs.large)), small=split(list(costs.small)))


def test_split_stages_run_the_measured_b_and_w_and_hold_what_b_keeps_except_the_first():
    layers = split_profiled().for_micro_batches(4)
    whole, split = modelled_stage_costs(layers, (4, 4), FREE), modelled_stage_costs(layers, (4, 4), FREE, split=True)
    assert split[0] == whole[0]  # the first stage sends no input gradient: it never splits
    linears = [c for c in layers[4:] if c.parameter_bytes]
    assert split[1].weight == pytest.approx(FREE.compute_scale * sum(c.weight_grad for c in linears))
    b_and_w = sum(c.input_grad + c.weight_grad for c in layers[4:])
    assert split[1].backward == pytest.approx(FREE.compute_scale * b_and_w) and split[1].backward > whole[1].backward
    assert split[1].activation_bytes == whole[1].activation_bytes + sum(c.kept_grad_bytes for c in linears)
    memory = predict(PipelinePlan(2, 1, 4, "never", "zb-h1", (4, 4)), split_profiled(), FREE, 0, 2**40).memory
    assert memory[1].transient == sum(c.parameter_bytes for c in layers[4:])  # W's products before .grad
    row = layers[0].output_bytes  # no transient of their own: the gradients between two layers, less what is freed
    assert memory[0].transient == row  # the first stage does not split


def test_copies_cost_each_stage_what_it_receives_and_sends():
    layers, model = profiled().for_micro_batches(4), dataclasses.replace(FREE, copy_bandwidth=1e9)
    free, copied = modelled_stage_costs(layers, (2, 3, 3), FREE), modelled_stage_costs(layers, (2, 3, 3), model)
    out = [stage.output_bytes for stage in free]
    assert [c.forward - f.forward for c, f in zip(copied, free)] == pytest.approx(
        [out[0] / 1e9, (out[0] + out[1]) / 1e9, out[1] / 1e9]
    )
    assert [c.backward - f.backward for c, f in zip(copied, free)] == pytest.approx(
        [c.forward - f.forward for c, f in zip(copied, free)]
    )
    # a recompute receives and sends nothing, and is none of the engine's bookkeeping: the forward's compute alone
    busy = dataclasses.replace(model, micro_batch_overhead=1e-3)
    recomputes = [c.recompute for c in modelled_stage_costs(layers, (2, 3, 3), busy)]
    assert recomputes == pytest.approx([f.forward for f in free])


def test_virtual_stages_are_planned_where_the_layers_allow_and_kept_when_fixed():
    costs = profiled(pairs=4)
    report = search(2, costs, 2**40, 0, FREE)
    interleaved = [p for p in report.predictions if p.plan.virtual_stages == 2]
    assert interleaved and all(p.plan.pipeline_parallel_size == 2 and len(p.plan.balance) == 4 for p in interleaved)
    assert {p.plan.virtual_stages for p in report.predictions if p.plan.pipeline_parallel_size == 1} == {1}
    fixed = search(2, costs, 2**40, 0, FREE, Constraints(pipeline_parallel_size=2, virtual_stages=2))
    assert {p.plan.virtual_stages for p in fixed.predictions} == {2}
    listed = search(2, costs, 2**40, 0, FREE, Constraints(balance=[2, 6]))
    assert {p.plan.virtual_stages for p in listed.predictions} == {1}  # a list balance without v: one chunk
    chunked = search(2, costs, 2**40, 0, FREE, Constraints(balance=[2, 2, 2, 2], virtual_stages=2))
    assert {(p.plan.pipeline_parallel_size, p.plan.balance) for p in chunked.predictions} == {(2, (2, 2, 2, 2))}
    assert all(p.plan.virtual_stages == 1 for p in search(2, profiled(pairs=1), 2**40, 0, FREE).predictions)


def test_an_interleaved_process_holds_its_chunks_together():
    """Process k runs virtual stages k and k + K: its parameters are both chunks', the head's output is on the process
    with the last virtual stage, and the step is the simulator's interleaved one."""
    costs, plan = profiled(pairs=4), PipelinePlan(2, 1, 4, "never", "1f1b", (2, 2, 2, 2), 2)
    predicted = predict(plan, costs, FREE, 0, 2**40)
    layers = costs.for_micro_batches(4)
    per_chunk = [sum(c.parameter_bytes for c in layers[2 * s : 2 * s + 2]) for s in range(4)]
    assert [m.parameters for m in predicted.memory] == [per_chunk[0] + per_chunk[2], per_chunk[1] + per_chunk[3]]
    stages = modelled_stage_costs(layers, plan.balance, FREE)
    assert predicted.step_time == pytest.approx(
        simulate(stages, 4, "never", schedule="1f1b", virtual_stages=2).step_time + FREE.step_overhead
    )
    assert predicted.memory[1].buffers > predicted.memory[0].buffers  # the backbone output's gradient


def test_the_report_is_a_table_and_plain_data():
    report = search(2, profiled(), 2**40, 1, FREE)
    data = json.loads(json.dumps(report.as_dict()))
    assert data["chosen"]["balance"] == list(report.chosen.plan.balance)
    assert len(data["runners_up"]) == len(report.runners_up) > 0
    table = report.table()
    assert table.splitlines()[2].startswith(" *") and f"{report.chosen.step_time:.4f}" in table


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="plan='x'"):
        PipelineConfig(plan="x")
    with pytest.raises(ValueError, match="add plan='auto'"):
        PipelineConfig(memory_limit=2**30)
    with pytest.raises(ValueError, match="drop\\s+balance_memory_limit"):
        PipelineConfig(plan="auto", memory_limit=2**30, balance_memory_limit=2**20)
    given = PipelineConfig(checkpoint="except_last").constraints()
    assert (given.checkpoint, given.schedule) == ("except_last", None)  # explicit, even at the default value
    assert (PipelineConfig().checkpoint, PipelineConfig().schedule) == ("except_last", "gpipe")
    assert PipelineConfig(plan="auto", memory_limit=1).constraints().virtual_stages is None  # the planner's choice
    assert PipelineConfig(plan="auto", memory_limit=1, virtual_stages=2).constraints().virtual_stages == 2
    assert PipelineConfig().virtual_stages == 1
    assert PipelineConfig(schedule="zb-v").virtual_stages == 2  # the V's two arms, kept by the planner
    assert PipelineConfig(plan="auto", memory_limit=1, schedule="zb-v").constraints().virtual_stages == 2


def test_the_planner_interleaves_only_where_the_strategy_has_run():
    """Virtual stages have run on gloo only: on CUDA v is fixed to 1 unless the user fixed it; a skip between two
    chunks of one stage goes through a turn, so skips do not hold interleaving back."""
    from lightning_gpipe.lightning.planner import _interleaving

    assert _interleaving(Constraints(), torch.device("cpu")).virtual_stages is None
    assert _interleaving(Constraints(), torch.device("cuda", 0)).virtual_stages == 1
    assert _interleaving(Constraints(virtual_stages=2), torch.device("cuda", 0)).virtual_stages == 2


def test_the_cpu_needs_a_memory_limit():
    config = PipelineConfig(plan="auto")

    def profile():
        raise AssertionError("nothing is profiled without a limit")

    with pytest.raises(ValueError, match="needs memory_limit=BYTES"):
        plan_for_strategy(None, "backbone", config, (1, 1), torch.device("cpu"), profile, lambda obj: obj)


class SmallMLP(pl.LightningModule):
    """Built in configure_model, as benchmarks/models.py's MLP; Adam."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = None

    def configure_model(self) -> None:
        if self.backbone is None:
            self.backbone = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())])
            self.head = nn.Linear(64, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


def test_plan_without_training_tells_how_many_devices_a_model_needs():
    batch = (torch.randn(32, 64), torch.randint(0, 2, (32,)))
    reports = {world: plan(SmallMLP(), world, 2**40, example_batch=batch) for world in (1, 2)}
    assert reports[2].chosen.memory[0].optimizer == 2 * reports[2].chosen.memory[0].parameters  # Adam, read
    smallest = {
        world: min(p.peak_bytes for p in r.predictions if p.plan.data_parallel_size == 1)
        for world, r in reports.items()
    }
    assert smallest[2] < smallest[1]
    limit = int((smallest[1] + smallest[2]) / 2 / (1 - CostModel().memory_margin))
    with pytest.raises(ValueError, match="No pipeline plan fits"):
        plan(SmallMLP(), 1, limit, example_batch=batch)
    assert plan(SmallMLP(), 2, limit, example_batch=batch, data_parallel_size=1).chosen.plan.pipeline_parallel_size == 2


def test_plan_auto_runs_the_chosen_plan_on_one_stage(tmp_path):
    module = SmallMLP()
    strategy = GPipeStrategy(plan="auto", memory_limit=2**30, schedule="gpipe")
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randint(0, 2, (64,)))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, default_root_dir=tmp_path,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    chosen = strategy.plan_report.chosen.plan
    assert {p.plan.schedule for p in strategy.plan_report.predictions} == {"gpipe"}  # given explicitly: kept
    assert (strategy.config.chunks, strategy.config.checkpoint, strategy.config.balance) == (
        chosen.micro_batches, chosen.checkpoint, list(chosen.balance),
    )  # fmt: skip
    assert chosen.options()["chunks"] == chosen.micro_batches and "micro_batches" not in chosen.options()
    assert trainer.global_step == 2


def test_a_plan_reports_repr_is_one_short_line_naming_the_chosen_plan():
    """``repr(report)`` (what a REPL or a log shows) names the chosen plan and how many fit, not every prediction."""
    batch = (torch.randn(32, 64), torch.randint(0, 2, (32,)))
    report = plan(SmallMLP(), 2, 2**30, example_batch=batch)
    text = repr(report)
    assert text.startswith("PlanReport(chosen: pipeline_parallel_size=") and "\n" not in text and len(text) < 400
    assert f"balance={list(report.chosen.plan.balance)!r}" in text and "MiB per device on 2 processes)" in text
    assert f"of {len(report.predictions)} plans fit 1,024 MiB" in text
