"""Predicting one pipeline plan: its step time, its bubble and every stage's peak memory.

Time is the simulator's step (:func:`lightning_gpipe.planning.simulator.simulate`, which replays the schedule's own
plans) over the layers' costs at the plan's micro-batch size (:class:`~lightning_gpipe.planning.costs.ProfiledCosts`),
with the engine's cost per micro-batch, the transfers between stages and the stage's own copies of them, the
optimizer step and, with several replicas, the gradient all-reduce (:class:`~lightning_gpipe.planning.costs.CostModel`).
Memory per stage (per process: its model chunks together) is parameters + gradients + optimizer state (+ DDP's
gradient buckets with several replicas; sharded by FSDP2, each process's ``1/D`` of them and the backward's gathered
parameters and unsharded gradients) + the simulator's peak of kept inputs and saved activations (and, under a B/W
split, the gradients B keeps for W) + what it holds for its transfers on top (outputs, sent gradients, the buffers of
received ones: :mod:`~lightning_gpipe.planning.held`) + the largest transient (a layer's, or W's products, or on the
last stage the tensors of what runs after the backbone: the loss's) + the batch every stage loads
(:class:`StageMemory`). The modules after the backbone add their parameters, gradients and optimizer state to the last
stage. With activation offload on an accelerator, the activations less what waits in host memory, and the step plus
the copies the schedule cannot hide (:mod:`~lightning_gpipe.planning.offload`).
PipeDream's planner (Narayanan et al. 2019, section 3.1) predicts from a per-layer profile the same way.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from lightning_gpipe.engine import DEFERRED_BY_DEFAULT, V_SHAPED, Kind, Plan, check, plans, virtual_stage
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.solver import stage_sums
from lightning_gpipe.planning.costs import CostModel, HeadCost, ProfiledCosts
from lightning_gpipe.planning.held import held_levels
from lightning_gpipe.planning.offload import exposed_seconds, offloaded_bytes
from lightning_gpipe.planning.simulator import Prediction, StageCost, Transfer, action_costs, simulate


@dataclass(frozen=True)
class PipelinePlan:
    """One way to run the pipeline: the mesh, the micro-batches, re-materialization, the schedule and the split.

    Args:
        pipeline_parallel_size: K, stages per pipeline.
        data_parallel_size: D, pipeline replicas.
        micro_batches: M, micro-batches per mini-batch (``GPipeStrategy(chunks=...)``).
        checkpoint: the re-materialization mode (``GPipeStrategy(checkpoint=...)``).
        schedule: a name of :data:`lightning_gpipe.engine.schedule.SCHEDULES`, run with its default B/W split
            (:data:`~lightning_gpipe.engine.schedule.DEFERRED_BY_DEFAULT`).
        balance: backbone layers per stage, ``K * virtual_stages`` entries (per virtual stage).
        virtual_stages: v, model chunks per stage (``GPipeStrategy(virtual_stages=...)``); 1 by default.
        sharding_strategy: how a stage's replicas hold its state (``GPipeStrategy(sharding_strategy=...)``);
            ``"NO_SHARD"`` (DDP) by default.
        offload: ``"activations"``: what a micro-batch's forward saves for its backward waits in host memory
            (``GPipeStrategy(offload=...)``); ``None`` (default): on the device.
        tensor_parallel_size: T, the tensor ranks of each stage (``GPipeStrategy(tensor_parallel_size=...)``), 1 by
            default; the plan is then predicted from one tensor rank's costs
            (:func:`~lightning_gpipe.planning.tensor.per_tensor_rank`), and its memory is one process's.
    """

    pipeline_parallel_size: int
    data_parallel_size: int
    micro_batches: int
    checkpoint: str
    schedule: str
    balance: tuple[int, ...]
    virtual_stages: int = 1
    sharding_strategy: str = "NO_SHARD"
    offload: str | None = None
    tensor_parallel_size: int = 1

    def options(self) -> dict:
        """The plan as ``GPipeStrategy`` keyword arguments (``micro_batches`` as ``chunks``, ``balance`` as a list;
        ``sharding_strategy`` only where it shards, ``offload`` only where it offloads, ``tensor_parallel_size`` only
        above 1)."""
        options = {("chunks" if key == "micro_batches" else key): value for key, value in asdict(self).items()}
        options["balance"] = list(self.balance)
        if self.sharding_strategy == "NO_SHARD":
            del options["sharding_strategy"]
        if self.offload is None:
            del options["offload"]
        if self.tensor_parallel_size == 1:
            del options["tensor_parallel_size"]
        return options

    @property
    def fully_sharded(self) -> bool:
        """Whether FSDP2 shards each stage's state over its replicas (a sharding strategy, and several replicas)."""
        return self.sharding_strategy != "NO_SHARD" and self.data_parallel_size > 1


@dataclass(frozen=True)
class StageMemory:
    """Predicted peak bytes of one stage, by what holds them.

    Args:
        parameters: parameters and buffers.
        gradients: one gradient per parameter.
        optimizer: the optimizer's state.
        activations: the simulator's peak of kept micro-batch inputs and saved activations.
        transfers: what the stage holds for its transfers on top of that, at its peak: outputs kept for the backward
            or by an unfinished send, input gradients sent, output gradients' receive buffers
            (:func:`~lightning_gpipe.planning.held.held_levels`).
        transient: the largest transient of the stage's layers on one micro-batch (``LayerCost.transient_bytes``):
            a layer's forward or backward runs on top of what the stage holds; under a B/W split, W's weight-gradient
            products if larger (the split model chunks' parameter bytes).
        buffers: the batches every stage loads (the current one and the next), DDP's buckets, the last stage's
            gradient of the backbone's output (and under fill-drain with several micro-batches their outputs joined).
        loss: on the last stage, what the tensors of what runs after the backbone (head, loss; ``HeadCost``) add to
            its peak: their peak for one run (on the whole mini-batch under fill-drain, on one micro-batch under a
            schedule that runs the user's step per micro-batch), less what the stage holds at its peak but not while
            they exist (the activations a re-materialized micro-batch recomputes after its loss). It runs while no
            layer does, so it and ``transient`` are not added: the larger counts.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int
    transfers: int = 0
    transient: int = 0
    loss: int = 0

    @property
    def total(self) -> int:
        """The bytes of the parts, the larger of ``transient`` and ``loss`` counted."""
        parts = (self.parameters, self.gradients, self.optimizer, self.activations, self.transfers, self.buffers)
        return sum(parts) + max(self.transient, self.loss)


@dataclass(frozen=True)
class PlanPrediction:
    """What :func:`predict` says of one :class:`PipelinePlan`.

    Args:
        plan: the plan.
        step_time: predicted seconds per optimizer step.
        bubble: predicted mean idle share of the stages.
        memory: per stage, its :class:`StageMemory`.
        batch_rows: rows of one replica's mini-batch.
        fits: whether every stage's total is within the usable memory (the limit less the model's margin).
    """

    plan: PipelinePlan
    step_time: float
    bubble: float
    memory: tuple[StageMemory, ...] = field(repr=False)
    batch_rows: int = 1
    fits: bool = True

    @property
    def peak_bytes(self) -> int:
        """The largest stage's predicted total."""
        return max(stage.total for stage in self.memory)

    @property
    def seconds_per_row(self) -> float:
        """Step time over the rows all replicas train per step: what the planner minimises (a plan with D
        replicas trains D mini-batches per step)."""
        return self.step_time / (self.plan.data_parallel_size * self.batch_rows)


def modelled_stage_costs(
    layers: Sequence[LayerCost], balance: Sequence[int], model: CostModel, split: bool = False
) -> list[StageCost]:
    """Per-(virtual-)stage costs for the simulator, each storage counted once.

    A tensor a layer saves as its output and the next layer saves as its input (ReLU, then Linear) is one storage;
    a stage's first layer saving its input holds the stage's kept input, which the simulator counts already; the
    first stage's input is a view of the batch (counted with the buffers). Layer times are scaled by
    ``model.compute_scale``; the engine's cost per micro-batch is added half to the forward, half to the backward,
    and the cost of copying what the stage receives and sends (``model.copy_time``: in the forward the input and the
    output, in the backward their gradients) to each. A recompute is the forward's compute alone: it receives and
    sends nothing (counting the copies and bookkeeping again would count them twice).
    With ``split`` (a schedule that splits its backwards into B and W), every stage after the first runs each
    layer's measured B and W (``LayerCost.input_grad`` and ``weight_grad``; a layer not measured so keeps its whole
    backward, with no W) and holds the gradients B keeps for W (``kept_grad_bytes``) with the micro-batch's saved
    activations (from its forward: an upper bound, they exist from its B); the first stage sends no input gradient,
    so it runs whole backwards (as the engine).
    """
    stages: list[StageCost] = []
    start, last = 0, len(balance) - 1
    for k, count in enumerate(balance):
        part = layers[start : start + count]
        start += count
        shared = sum(min(a.output_saved_bytes, b.input_saved_bytes) for a, b in zip(part, part[1:]))
        halves = [_halves(c) if split and k > 0 else (c.backward, 0.0) for c in part]
        received = 0 if k == 0 else stages[-1].output_bytes
        moved = model.copy_time(received + (part[-1].output_bytes if k < last else 0))  # each way, per micro-batch
        engine = model.micro_batch_overhead / 2 + moved
        kept = sum(c.kept_grad_bytes for c in part) if split and k > 0 else 0  # B's gradients kept for W
        forward = model.compute_scale * sum(c.forward for c in part)
        stages.append(
            StageCost(
                forward=forward + engine,
                backward=model.compute_scale * sum(b + w for b, w in halves) + engine,
                input_bytes=received,
                activation_bytes=sum(c.activation_bytes for c in part) - shared - part[0].input_saved_bytes + kept,
                output_bytes=part[-1].output_bytes,
                weight=model.compute_scale * sum(w for _, w in halves),
                recompute=forward,
            )
        )
    return stages


def _halves(cost: LayerCost) -> tuple[float, float]:
    """A layer's B and W seconds when its backward is split; its whole backward and no W if they were not
    measured."""
    if cost.input_grad or cost.weight_grad:
        return cost.input_grad, cost.weight_grad
    return cost.backward, 0.0


def predict(
    plan: PipelinePlan,
    profiled: ProfiledCosts,
    model: CostModel,
    state_factor: int,
    limit: float,
    device_type: str = "cpu",
) -> PlanPrediction:
    """Predict ``plan``'s step and memory (see the module docstring).

    With virtual stages a process's memory is the sum over its model chunks; what its model chunks hold for their
    transfers is each model chunk's peak added up (an upper bound: the model chunks' peaks need not coincide).
    With ``plan.offload`` on an accelerator, each process's activations drop by what offload keeps in host memory and
    its step grows by the copies the schedule cannot hide (:mod:`~lightning_gpipe.planning.offload`); on a CPU
    offload moves nothing, so it changes nothing.

    Args:
        plan: the plan.
        profiled: the layers' costs at two micro-batch sizes, and what runs after the backbone.
        model: the machine's constants.
        state_factor: tensors of a parameter's size the optimizer keeps (see
            :func:`~lightning_gpipe.planning.costs.optimizer_state_factor`).
        limit: bytes per device; a plan fits if every stage's total is within ``limit * (1 - model.memory_margin)``.
        device_type: the devices' type (``"cpu"``, default, or ``"cuda"``...).

    Raises:
        ValueError: if the schedule's plans (placed by these costs) fail :func:`~lightning_gpipe.engine.schedule.check`.
    """
    rows_n = profiled.batch_rows
    micro_batches = min(plan.micro_batches, rows_n)
    layers = profiled.for_micro_batches(micro_batches)
    stages = modelled_stage_costs(layers, plan.balance, model, DEFERRED_BY_DEFAULT[plan.schedule])
    every = _checked_plans(plan, stages, micro_batches)
    params, replicas = _parameters(plan, layers, profiled.head), plan.data_parallel_size
    simulated = _step(plan, stages, params, model, state_factor, micro_batches)
    joined = profiled.at(rows_n)[-1].output_bytes
    held = _held(plan, every, micro_batches, stages, layers)
    moves = plan.offload is not None and device_type != "cpu"  # on a CPU offload moves nothing
    offloaded = [_offloaded(plan, k, own, stages, layers, model, micro_batches, moves) for k, own in enumerate(every)]
    memory = tuple(
        StageMemory(
            **_state(plan, p, state_factor),
            activations=max(simulated.peak_activation_bytes[k] - offloaded[k][0], 0),
            buffers=_buffers(plan, stages, k, profiled.input_bytes, joined, every[k], micro_batches)
            + p * (replicas > 1 and not plan.fully_sharded),
            transfers=max(held[k][0] - simulated.peak_activation_bytes[k], 0),
            transient=_transient(plan, layers, stages, k),
            loss=max(_loss(plan, profiled, every[k].loss_per_micro_batch, k) - held[k][1], 0),
        )
        for k, p in enumerate(params)
    )
    usable = limit * (1 - model.memory_margin)
    return PlanPrediction(
        plan,
        simulated.step_time + model.step_overhead + max(seconds for _, seconds in offloaded),
        simulated.bubble,
        memory,
        rows_n,
        all(stage.total <= usable for stage in memory),
    )


def _checked_plans(plan: PipelinePlan, stages: Sequence[StageCost], micro_batches: int) -> list[Plan]:
    """Every process's plan of ``plan``'s schedule, placed by ``stages``' costs as the simulator places them, checked
    (:func:`~lightning_gpipe.engine.schedule.check`: a plan that cannot run raises ``ValueError``)."""
    k, v = plan.pipeline_parallel_size, plan.virtual_stages
    every = plans(plan.schedule, k, micro_batches, plan.checkpoint, None, v, action_costs(stages))
    check(every)
    return every


def _step(
    plan: PipelinePlan,
    stages: Sequence[StageCost],
    params: Sequence[int],
    model: CostModel,
    state_factor: int,
    micro_batches: int,
) -> Prediction:
    """The simulator's step of ``plan`` over ``stages``, each process's optimizer step (over its ``params`` bytes)
    and gradient all-reduce at its end, the transfers as ``model`` times them."""
    replicas = plan.data_parallel_size
    optimizer = [model.optimizer_time(p, state_factor) + model.all_reduce_time(p, replicas) for p in params]
    transfer = Transfer(model.transfer_latency, model.transfer_bandwidth)
    shape = (micro_batches, plan.checkpoint, plan.schedule, plan.virtual_stages)
    return _simulated(tuple(stages), transfer, tuple(optimizer), *shape)


@lru_cache(maxsize=256)
def _simulated(
    stages: tuple[StageCost, ...],
    transfer: Transfer,
    optimizer: tuple[float, ...],
    micro_batches: int,
    checkpoint: str,
    schedule: str,
    virtual_stages: int,
) -> Prediction:
    """:func:`~lightning_gpipe.planning.simulator.simulate`'s step, kept for the plans that differ only in what it
    does not see (sharding, offload)."""
    return simulate(
        stages, micro_batches, checkpoint, transfer, optimizer=optimizer, schedule=schedule,
        virtual_stages=virtual_stages,
    )  # fmt: skip


def _offloaded(
    plan: PipelinePlan,
    k: int,
    own: Plan,
    stages: Sequence[StageCost],
    layers: Sequence[LayerCost],
    model: CostModel,
    micro_batches: int,
    moves: bool = True,
) -> tuple[int, float]:
    """Process ``k``'s bytes of saved activations that offload keeps in host memory at its peak, and the seconds its
    copies add to the step (:mod:`~lightning_gpipe.planning.offload`; ``own``: its plan). Per model chunk, offload
    moves what its forward saves but the chunk's kept input (not in ``activation_bytes``), its last layer's output
    and the gradients B keeps for W (which the engine keeps on the device). Nothing where offload ``moves`` nothing
    (no offload, or a CPU)."""
    if not moves:
        return 0, 0.0
    moved, forward = [], []
    for s in _model_chunks_of(plan, k):
        part = _stage_layers(layers, plan.balance, s)
        kept = sum(c.kept_grad_bytes for c in part) if stages[s].weight else 0
        moved.append(max(stages[s].activation_bytes - kept - part[-1].output_saved_bytes, 0))
        forward.append(stages[s].forward)
    return (
        offloaded_bytes(own, plan.checkpoint, micro_batches, moved),
        exposed_seconds(own, plan.checkpoint, micro_batches, moved, forward, model),
    )


def state_copies(state_factor: int, replicas: int = 1, sharded: bool = False) -> float:
    """Bytes a process holds for the state of each byte of its stage's parameters at its peak, as :func:`predict`
    counts them (:func:`_state`, :class:`StageMemory`): the parameters, their gradients and ``state_factor`` optimizer
    tensors, and with several replicas under DDP its gradient buckets: ``3 + state_factor``; sharded by FSDP2 over
    ``replicas`` (``sharded``, several replicas): ``1/D`` of each and, in the backward, the gathered parameters and
    their unsharded gradients, ``2 + (2 + state_factor) / D`` (4 with AdamW over two replicas, against DDP's 5).

    Args:
        state_factor: tensors of a parameter's size the optimizer keeps (see
            :func:`~lightning_gpipe.planning.costs.optimizer_state_factor`).
        replicas: D, the stage's replicas (default 1).
        sharded: whether FSDP2 shards the state (``sharding_strategy`` other than ``"NO_SHARD"``; default ``False``).
    """
    if sharded and replicas > 1:
        return 2 + (2 + state_factor) / replicas
    return 2 + state_factor + (replicas > 1)


def _state(plan: PipelinePlan, p: int, state_factor: int) -> dict[str, int]:
    """A process's parameter, gradient and optimizer-state bytes at its peak, of a stage with ``p`` bytes of
    parameters: whole under DDP (whose gradient buckets, another ``p``, are counted with the buffers); sharded over
    the D replicas by FSDP2 (docs/scaling.md, "Sharding a stage over its replicas"): each process holds ``1/D`` of
    each, and in the backward also the gathered parameters and their unsharded gradients (``16 P / D + 8 P`` with
    AdamW in fp32)."""
    if not plan.fully_sharded:
        return {"parameters": p, "gradients": p, "optimizer": state_factor * p}
    shard = math.ceil(p / plan.data_parallel_size)
    return {"parameters": shard + p, "gradients": shard + p, "optimizer": state_factor * shard}


def _parameters(plan: PipelinePlan, layers: Sequence[LayerCost], head: HeadCost | None) -> list[int]:
    """Per process, the bytes of its layers' parameters and buffers; on the process with the last stage also the
    modules' after the backbone (``head``)."""
    per_virtual = stage_sums([c.parameter_bytes for c in layers], plan.balance)
    extra, last = (head.parameter_bytes if head is not None else 0), len(plan.balance) - 1
    return [
        round(sum(per_virtual[s] for s in _model_chunks_of(plan, k)))
        + (extra if last in _model_chunks_of(plan, k) else 0)
        for k in range(plan.pipeline_parallel_size)
    ]


def _loss(plan: PipelinePlan, profiled: ProfiledCosts, per_micro_batch: bool, k: int) -> int:
    """Process ``k``'s bytes of what runs after the backbone (:class:`~lightning_gpipe.planning.costs.HeadCost`) on
    the rows of one run: on the process with the last stage, the whole mini-batch's, or one micro-batch's where the
    plan runs the user's step ``per_micro_batch``; 0 elsewhere or where it was not measured."""
    if profiled.head is None or len(plan.balance) - 1 not in _model_chunks_of(plan, k):
        return 0
    rows = profiled.batch_rows
    return profiled.head.at(math.ceil(rows / min(plan.micro_batches, rows)) if per_micro_batch else rows)


def _model_chunks_of(plan: PipelinePlan, k: int) -> list[int]:
    """The virtual stages process ``k`` runs, in model chunk order: ``k``, ``k + K``, ... (one without virtual stages;
    in a V, :func:`~lightning_gpipe.engine.actions.virtual_stage`)."""
    v_shape = plan.schedule in V_SHAPED
    return [virtual_stage(k, c, plan.pipeline_parallel_size, v_shape) for c in range(plan.virtual_stages)]


def _stage_layers(layers: Sequence[LayerCost], balance: Sequence[int], s: int) -> Sequence[LayerCost]:
    """(Virtual) stage ``s``'s layers."""
    start = sum(balance[:s])
    return layers[start : start + balance[s]]


def _process_layers(plan: PipelinePlan, layers: Sequence[LayerCost], k: int) -> list[LayerCost]:
    """The layers of process ``k``'s model chunks."""
    return [c for s in _model_chunks_of(plan, k) for c in _stage_layers(layers, plan.balance, s)]


def _transient(plan: PipelinePlan, layers: Sequence[LayerCost], stages: Sequence[StageCost], k: int) -> int:
    """Process ``k``'s transient: its largest layer's (:func:`_layer_transient`), or where its model chunks split their
    backwards, the weight-gradient products of W (:func:`~lightning_gpipe.engine.weightgrad.run_together` computes every
    linear layer's before adding them to ``.grad``), as large as the parameters of those model chunks, if that is
    larger."""
    largest = max(_layer_transient(_stage_layers(layers, plan.balance, s)) for s in _model_chunks_of(plan, k))
    split = [s for s in _model_chunks_of(plan, k) if stages[s].weight]
    products = sum(c.parameter_bytes for s in split for c in _stage_layers(layers, plan.balance, s))
    return max(largest, products)


def _layer_transient(part: Sequence[LayerCost]) -> int:
    """The most a (virtual) stage's layer adds for a moment to what the stage holds at its peak: its profiled
    transient, and in its backward the gradients of its output and of its input, which live between two layers of the
    stage (the stage's output and input gradients, received and sent, are counted with its transfers); less what the
    layers after it keep of the micro-batch, which its backward runs after they were freed and its forward before they
    exist (their saved tensors but their inputs, which a layer before may keep too)."""
    last = len(part) - 1
    return max(
        cost.transient_bytes
        + cost.output_bytes * (j < last)
        + (part[j - 1].output_bytes if j else 0)
        - sum(later.activation_bytes - later.input_saved_bytes for later in part[j + 1 :])
        for j, cost in enumerate(part)
    )


def _held(
    plan: PipelinePlan,
    every: Sequence[Plan],
    micro_batches: int,
    stages: Sequence[StageCost],
    layers: Sequence[LayerCost],
) -> list[tuple[int, int]]:
    """Per process, the peak bytes of kept inputs, saved activations and what it holds for its transfers, walked over
    each model chunk's actions of the process's own plan (of ``every``, the plan's per process:
    :func:`~lightning_gpipe.planning.held.held_levels`) and added up over its model chunks; and for the model chunk
    with the last stage, what of its peak it does not hold where the user's loss runs (0 elsewhere)."""
    found = []
    for k, stage_plan in enumerate(every):
        peak = spared = 0
        for c, s in enumerate(_model_chunks_of(plan, k)):
            stage, last = stages[s], _stage_layers(layers, plan.balance, s)[-1]
            per_micro = (stage.input_bytes, stage.activation_bytes, stage.output_bytes, last.output_saved_bytes)
            actions = [
                a for a in stage_plan.actions if a.model_chunk == c or a.kind is Kind.FLUSH
            ]  # a flush: every model chunk's
            model_chunk_peak, at_loss = held_levels(
                actions, s < len(stages) - 1, plan.checkpoint, micro_batches, per_micro
            )
            peak += model_chunk_peak
            spared += model_chunk_peak - at_loss if s == len(stages) - 1 else 0
        found.append((peak, spared))
    return found


def _buffers(
    plan: PipelinePlan,
    stages: Sequence[StageCost],
    k: int,
    batch_bytes: int,
    joined: int,
    own: Plan,
    micro_batches: int,
) -> int:
    """Bytes of process ``k``'s buffers (``own``: its plan, of ``micro_batches``): two batches (every stage
    loads them: Lightning's loop fetches the next batch before the step on the current one ends), and on the process
    with the last stage the gradient of the backbone's output the user's step takes: under fill-drain with several
    micro-batches, the whole mini-batch's output (``joined``, a copy of the micro-batches' outputs) and its gradient;
    with one micro-batch (not copied) or where the plan runs the user's step per micro-batch, one micro-batch's output
    gradient. The micro-batches' outputs the stage keeps, the input gradients it sends and the output gradients it
    receives are ``StageMemory.transfers``."""
    last = len(stages) - 1
    if last not in _model_chunks_of(plan, k):
        return 2 * batch_bytes
    if micro_batches > 1 and not own.loss_per_micro_batch:
        return 2 * batch_bytes + 2 * joined
    return 2 * batch_bytes + stages[last].output_bytes
