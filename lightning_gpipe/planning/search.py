"""Choosing the plan: every feasible (mesh, micro-batches, checkpoint, schedule, virtual stages, sharding, offload)
with its best balance, predicted, ranked.

The candidates are every pipeline x data-parallel size whose product is the world size, M (micro-batches) in powers of
two up to the mini-batch's rows (and :data:`MAX_MICRO_BATCHES`), every re-materialization mode, every schedule of
:data:`lightning_gpipe.engine.schedule.SCHEDULES` (so a schedule added there is planned for too; one that splits its
backwards into B and W, the zero-bubble and V schedules, only where the profile measured B and W and on two stages or
more, a V schedule only with its two model chunks per stage), and each of :data:`VIRTUAL_STAGES` model chunks per
stage that the layers allow (each plan, placed by its costs, checked by :func:`~lightning_gpipe.engine.schedule.check`
before it is predicted); with several replicas, the stage's state whole (``"NO_SHARD"``) or sharded by FSDP2
(``"SHARD_GRAD_OP"``: ``"FULL_SHARD"`` holds the same peak and gathers more); on an accelerator, with and without
activation offload where nothing is re-materialized (a re-materialized forward saves nothing to move; on a CPU
offload moves nothing); minus what the user fixed (:class:`Constraints`). For each, the balance is the time-optimal
split into ``K * v`` (virtual) stages (:func:`~lightning_gpipe.planning.balance.solve`) if it fits the memory limit,
else (one model chunk per stage only) the fastest split whose stages fit by the additive part of their memory
(parameters, gradients, optimizer state as the run holds them, sharded or not; saved activations; the boundaries' share
is reserved for the largest layer output), walked a layer at a time towards one that fits by the whole prediction if
neither does (with two stages, every split predicted). Each plan is predicted
(:func:`~lightning_gpipe.planning.predict.predict`); the fastest per row that fits wins, and at equal predicted time the
one without sharding and without offload (they cost what the model does not see: FSDP2's and the copies' bookkeeping).
PipeDream's planner (Narayanan et al. 2019, section 3.1) chose partition and replication from a profile alike."""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import product
from typing import cast

from lightning_gpipe.engine import CHECKPOINT_MODES, DEFERRED_BY_DEFAULT, SCHEDULES, V_SHAPED
from lightning_gpipe.planning.balance.choose import balance_by
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.solver import solve, stage_sums
from lightning_gpipe.planning.costs import CostModel, ProfiledCosts
from lightning_gpipe.planning.predict import PipelinePlan, PlanPrediction, predict, state_copies
from lightning_gpipe.planning.report import PlanReport, no_plan_fits

MAX_MICRO_BATCHES = 64
"""The most micro-batches the planner tries (unless the user fixes M, ``GPipeStrategy(chunks=...)``)."""

VIRTUAL_STAGES = (1, 2)
"""The model chunks per stage the planner tries (unless the user fixes ``virtual_stages``). Each model chunk more adds a
transfer per micro-batch each way; on the project's CPU machine two model chunks were already slower than one
(docs/benchmarks.md, "Interleaved virtual stages"), so more are not tried."""


@dataclass(frozen=True)
class Constraints:
    """What the user fixed; ``None`` leaves it to the planner. Same meanings as ``GPipeStrategy``'s arguments.

    Args:
        pipeline_parallel_size: K.
        data_parallel_size: D.
        micro_batches: M (``GPipeStrategy(chunks=...)``).
        checkpoint: the re-materialization mode.
        schedule: the schedule's name.
        balance: layers per (virtual) stage (a list fixes the split, and K with ``virtual_stages``), or a mode of
            :data:`lightning_gpipe.planning.balance.MODES` that chooses the split.
        virtual_stages: v, model chunks per stage (a list ``balance`` without it means 1).
        sharding_strategy: how a stage's replicas hold its state (``"NO_SHARD"``, ``"SHARD_GRAD_OP"``,
            ``"FULL_SHARD"``); ``None``: the planner chooses between ``"NO_SHARD"`` and ``"SHARD_GRAD_OP"`` where there
            are several replicas.
        offload: ``"activations"``, or ``False`` for none; ``None``: the planner's choice (only on an accelerator).
        tensor_parallel_size: T, the tensor ranks of each stage, always fixed (default 1); the profile the planner is
            given is then one tensor rank's (:func:`~lightning_gpipe.planning.tensor.per_tensor_rank`).
    """

    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    micro_batches: int | None = None
    checkpoint: str | None = None
    schedule: str | None = None
    balance: None | str | Sequence[int] = None
    virtual_stages: int | None = None
    sharding_strategy: str | None = None
    offload: str | bool | None = None
    tensor_parallel_size: int = 1

    @property
    def splits(self) -> bool:
        """Whether the planner needs the backbone's B and W profiled: the schedule is free (it considers the schedules
        that split their backwards) or splits them by default."""
        return self.schedule is None or DEFERRED_BY_DEFAULT.get(self.schedule, False)

    @property
    def listed(self) -> bool:
        """Whether ``balance`` is a list of layers per stage."""
        return isinstance(self.balance, (list, tuple))


def meshes(world_size: int, num_layers: int, constraints: Constraints) -> list[tuple[int, int]]:
    """The ``(K, D)`` pairs with ``K * D * T == world_size`` (T: ``constraints.tensor_parallel_size``) and at most one
    stage per layer that ``constraints`` allow.

    Raises:
        ValueError: if none is left, naming the constraints that exclude them all.
    """
    listed = constraints.balance if constraints.listed else None
    fixed_k = len(listed) / (constraints.virtual_stages or 1) if listed is not None else None  # no k if fractional
    tensor = constraints.tensor_parallel_size
    pipelines = world_size // tensor if world_size % tensor == 0 else 0
    pairs = [
        (k, pipelines // k)
        for k in range(1, pipelines + 1)
        if pipelines % k == 0
        and k <= num_layers
        and constraints.pipeline_parallel_size in (None, k)
        and constraints.data_parallel_size in (None, pipelines // k)
        and fixed_k in (None, k)
    ]
    if not pairs:
        raise ValueError(
            f"No mesh of {world_size} processes fits the constraints pipeline_parallel_size="
            f"{constraints.pipeline_parallel_size!r}, data_parallel_size={constraints.data_parallel_size!r},"
            f" tensor_parallel_size={tensor}, balance={constraints.balance!r} and a backbone of {num_layers} layers:"
            " the sizes must multiply to the world size, a list balance fixes the stages, and a stage needs at least"
            " one layer. Drop or change one."
        )
    return pairs


def micro_batch_counts(rows: int, fixed: int | None = None) -> list[int]:
    """The M (micro-batches) the planner tries for a mini-batch of ``rows`` rows: ``fixed`` if the user fixed it, else
    the powers of two up to ``rows`` and :data:`MAX_MICRO_BATCHES`."""
    if fixed is not None:
        return [fixed]
    return [2**i for i in range(MAX_MICRO_BATCHES.bit_length()) if 2**i <= min(rows, MAX_MICRO_BATCHES)]


def candidates(
    world_size: int, profiled: ProfiledCosts, constraints: Constraints, device_type: str = "cpu"
) -> Iterator[tuple]:
    """Every ``(K, D, M, checkpoint, schedule, v, sharding_strategy, offload)`` the constraints allow on devices of
    ``device_type`` (see the module docstring)."""
    num_layers = len(profiled.large)
    micro_batches = micro_batch_counts(profiled.batch_rows, constraints.micro_batches)
    modes = [constraints.checkpoint] if constraints.checkpoint is not None else list(CHECKPOINT_MODES)
    split = any(c.weight_grad for c in profiled.large)  # B and W measured: the schedules that split them are planned
    free = [name for name in SCHEDULES if split or not DEFERRED_BY_DEFAULT[name]]
    schedules = [constraints.schedule] if constraints.schedule is not None else free
    if constraints.virtual_stages is not None:
        virtual = [constraints.virtual_stages]
    else:
        virtual = [1] if constraints.listed else list(VIRTUAL_STAGES)
    offloads = _offloads(constraints, device_type)
    grid = product(meshes(world_size, num_layers, constraints), micro_batches, modes, schedules, virtual)
    for (k, d), m, mode, schedule, v in grid:
        if m == 1 and mode == "except_last" and constraints.checkpoint is None:
            continue  # the same plan as "never": one micro-batch, the last, is never recomputed
        if v > 1 and (k == 1 or k * v > num_layers):
            continue  # interleaving needs two stages and a layer per virtual stage
        if k == 1 and DEFERRED_BY_DEFAULT[schedule] and constraints.schedule is None:
            continue  # one stage sends no input gradient, so it never splits: the plan of whole backwards
        if schedule in V_SHAPED and v != 2:
            continue  # a V has two arms
        for sharding, offload in product(_shardings(constraints, d), offloads):
            if offload is None or mode == "never" or constraints.offload is not None:
                yield k, d, m, mode, schedule, v, sharding, offload  # re-materialized forwards save nothing to move


def _shardings(constraints: Constraints, replicas: int) -> list[str]:
    """The sharding strategies to plan with ``replicas`` replicas: the user's, or ``"NO_SHARD"`` and (with several
    replicas) ``"SHARD_GRAD_OP"``; with several replicas of tensor-parallel stages ``"SHARD_GRAD_OP"`` alone (DDP
    takes no tensor-parallel parameters)."""
    if constraints.sharding_strategy is not None:
        return [constraints.sharding_strategy]
    if replicas == 1:
        return ["NO_SHARD"]
    return ["SHARD_GRAD_OP"] if constraints.tensor_parallel_size > 1 else ["NO_SHARD", "SHARD_GRAD_OP"]


def _offloads(constraints: Constraints, device_type: str) -> list[str | None]:
    """The offload modes to plan: the user's (``False``: none), or none and, on an accelerator without tensor-parallel
    stages (whose ``DTensor`` activations offload has not run), ``"activations"``."""
    if constraints.offload is not None:
        return [constraints.offload if isinstance(constraints.offload, str) else None]  # False: none
    return [None, "activations"] if device_type != "cpu" and constraints.tensor_parallel_size == 1 else [None]


def search(
    world_size: int,
    profiled: ProfiledCosts,
    memory_limit: float,
    state_factor: int,
    model: CostModel = CostModel(),
    constraints: Constraints = Constraints(),
    device_type: str = "cpu",
) -> PlanReport:
    """Predict every candidate plan and choose the fastest per row that fits ``memory_limit`` bytes per device.

    Args:
        world_size: processes (devices) of the job.
        profiled: the backbone layers' costs at two micro-batch sizes (one tensor rank's, with
            ``constraints.tensor_parallel_size`` > 1: :func:`~lightning_gpipe.planning.tensor.per_tensor_rank`).
        memory_limit: bytes each device may hold.
        state_factor: tensors of a parameter's size the optimizer keeps (see
            :func:`~lightning_gpipe.planning.costs.optimizer_state_factor`).
        model: the machine's constants.
        constraints: what the user fixed.
        device_type: the devices' type: ``"cpu"`` (default; offload is never planned there) or ``"cuda"``...

    Raises:
        ValueError: if the constraints leave no candidate (naming them), or if no candidate fits the limit (naming
            the smallest limit that would fit, see :func:`~lightning_gpipe.planning.report.no_plan_fits`).
    """
    predictions = []
    for k, d, m, mode, schedule, v, sharding, offload in candidates(world_size, profiled, constraints, device_type):
        plan = PipelinePlan(k, d, m, mode, schedule, (), v, sharding, offload, constraints.tensor_parallel_size)
        predictions += _shape_predictions(plan, profiled, state_factor, memory_limit, model, constraints, device_type)
    predictions.sort(key=_rank)
    report = PlanReport(predictions, memory_limit, world_size, model, profiled, state_factor)
    if not predictions[0].fits:
        raise no_plan_fits(report)
    return report


def _rank(prediction: PlanPrediction) -> tuple:
    """The order of the report: fitting first, then by predicted seconds per row, then without sharding and without
    offload (at equal time, what the model does not see of them decides), then by peak."""
    plan = prediction.plan
    extras = (plan.sharding_strategy != "NO_SHARD", plan.offload is not None)
    return (not prediction.fits, prediction.seconds_per_row, *extras, prediction.peak_bytes)


WALK_MOVES = 32
"""The most layers :func:`_walk` moves across stage boundaries for one candidate."""


def _shape_predictions(
    shape: PipelinePlan,
    profiled: ProfiledCosts,
    state_factor: int,
    limit: float,
    model: CostModel,
    constraints: Constraints,
    device_type: str,
) -> list[PlanPrediction]:
    """The predictions of one candidate ``shape`` (a plan without its balance): of its splits
    (:func:`_balances`) and, where none of them fits by the whole prediction (buffers, transfers and transients are
    not additive and differ by stage), of the split :func:`_walk` reaches from the closest, so that a candidate some
    split fits is not refused for the first splits' sake."""
    balances = _balances(
        profiled.for_micro_batches(shape.micro_batches), shape, state_factor, limit, model, constraints
    )
    plans = [replace(shape, balance=tuple(b)) for b in balances]
    found = [predict(plan, profiled, model, state_factor, limit, device_type) for plan in plans]
    if any(p.fits for p in found) or shape.virtual_stages > 1 or constraints.balance is not None:
        return found
    closest = min(found, key=lambda p: p.peak_bytes)
    reached = _walk(closest, profiled, state_factor, limit, model, device_type)
    return found if reached is closest else [*found, reached]


def _walk(
    start: PlanPrediction, profiled: ProfiledCosts, state_factor: int, limit: float, model: CostModel, device_type: str
) -> PlanPrediction:
    """From ``start`` (one model chunk per stage), move one layer across one stage boundary at a time, the move that
    lowers the largest stage's predicted peak most, while the plan does not fit and a move lowers it, at most
    :data:`WALK_MOVES` times (the part of a stage's memory that is not additive, its buffers, transfers and transients,
    moves with the boundary, and need not fall steadily along the layers); returns the fastest of the first moves that
    fit, else the prediction reached (``start`` if no move lowers its peak). With two stages every split is predicted
    instead (one per layer): the fastest that fits, else the one of the lowest peak."""
    if len(start.plan.balance) == 2:
        layers = sum(start.plan.balance)
        splits = [replace(start.plan, balance=(j, layers - j)) for j in range(1, layers)]
        tried = [predict(plan, profiled, model, state_factor, limit, device_type) for plan in splits]
        fitting = [p for p in tried if p.fits]
        return min(fitting, key=lambda p: p.step_time) if fitting else min([start, *tried], key=lambda p: p.peak_bytes)
    current = start  # does not fit
    for _ in range(WALK_MOVES):
        plans = [replace(current.plan, balance=moved) for moved in _one_layer_moves(current.plan.balance)]
        tried = [predict(plan, profiled, model, state_factor, limit, device_type) for plan in plans]
        fitting = [p for p in tried if p.fits]
        if fitting:
            return min(fitting, key=lambda p: p.step_time)
        best = min(tried, key=lambda p: p.peak_bytes, default=current)  # one stage: no boundary to move
        if best.peak_bytes >= current.peak_bytes:
            break
        current = best
    return current


def _one_layer_moves(balance: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every split one layer away from ``balance`` across one boundary, no stage left empty."""
    moves = []
    for j in range(len(balance) - 1):
        for source, to in ((j, j + 1), (j + 1, j)):
            if balance[source] > 1:
                moved = list(balance)
                moved[source] -= 1
                moved[to] += 1
                moves.append(tuple(moved))
    return moves


def _balances(
    layers: Sequence[LayerCost],
    shape: PipelinePlan,
    state_factor: int,
    limit: float,
    model: CostModel,
    constraints: Constraints,
) -> list[list[int]]:
    """The splits to predict for one candidate ``shape``: the user's, or the time-optimal one into ``K * v`` stages
    and, with one model chunk per stage when the memory limit binds, the fastest one whose stages fit by their
    additive memory (if any)."""
    k, m, mode, v = shape.pipeline_parallel_size, shape.micro_batches, shape.checkpoint, shape.virtual_stages
    if constraints.listed:
        return [list(cast("Sequence[int]", constraints.balance))]  # listed: a list or tuple of ints
    if isinstance(constraints.balance, str):
        return [balance_by(constraints.balance, layers, k * v)]
    times = [c.forward + c.backward for c in layers]
    fastest = solve(times, k * v)
    if v > 1:
        return [fastest]  # a process's memory is its model chunks' together, which a split by stages cannot bound
    held = m if mode == "never" else (min(2, m) if shape.schedule != "gpipe" and mode == "except_last" else 1)
    copies = state_copies(state_factor, shape.data_parallel_size, shape.fully_sharded)
    additive = _additive_memory(layers, held, copies)
    reserve = (m + 3) * max(c.output_bytes for c in layers)
    usable = limit * (1 - model.memory_margin) - reserve
    if max(stage_sums(additive, fastest)) <= usable:
        return [fastest]
    try:
        return [fastest, solve(times, k, memory=additive, memory_limit=max(usable, 0.0))]
    except ValueError:
        return [fastest]


def _additive_memory(layers: Sequence[LayerCost], held: int, parameter_copies: float) -> list[float]:
    """Each layer's part of a stage's memory that adds up along the stage: ``parameter_copies`` times its parameters
    and ``held`` micro-batches of its saved activations (a storage shared with the previous layer counted once)."""
    memory: list[float] = []
    for j, cost in enumerate(layers):
        shared = min(layers[j - 1].output_saved_bytes, cost.input_saved_bytes) if j else 0
        memory.append(parameter_copies * cost.parameter_bytes + held * (cost.activation_bytes - shared))
    return memory
