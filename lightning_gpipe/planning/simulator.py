"""Predict one pipeline training step from per-layer costs: step time, bubble and peak activation memory per stage.

Each stage runs the compute actions of its plan (:func:`lightning_gpipe.engine.schedule.plans`, the lists the runtime
executes) in their order; a piece of work starts once the stage is free and its input is there.
``schedule="gpipe"`` is GPipe's fill-drain (Huang et al. 2019, section 2.2 and Figure 2,
:func:`lightning_gpipe.engine.schedule.gpipe`):

- Fill: stage k runs the forward of micro-batches 0 .. M-1 in order; micro-batch i starts once stage k is
  free and its input has arrived from stage k-1 (the forward's end there plus the transfer time).
- The last stage then runs the user's head and loss and their backward to the boundary (``loss``).
- Drain: every stage runs micro-batches M-1 .. 0. A checkpointed micro-batch's forward is recomputed
  first, *before* the stage waits for its gradient; its backward starts once the gradient has arrived
  from stage k+1 (that stage's backward end plus the transfer time). With a deferred weight gradient
  (``StageCost.weight``, zero-bubble's W), the input gradient is sent after the backward's B part and the
  W part follows, except on the last stage without re-materialization, which runs every W after its last B
  (:func:`lightning_gpipe.engine.schedule.weights_after_drain`).
- Each stage ends with its optimizer step (``optimizer``).

``schedule="1f1b"`` is PipeDream-Flush (Narayanan et al. 2021, :func:`lightning_gpipe.engine.schedule.one_f_one_b`):
stage k runs ``min(K - k - 1, M)`` forwards, then alternates one forward and one backward, then the remaining
backwards; on the last stage each micro-batch's forward is followed by its share of the head and loss (``loss / M``)
and at once by its backward.
``schedule="zb-h1"`` is zero-bubble's ZB-H1 (Qi et al. 2023, :func:`lightning_gpipe.engine.schedule.zero_bubble_h1`):
1F1B's order with the B/W split, stage k running each W ``k`` micro-batches after its B.
``"zb-1p"`` and ``"zb-v"`` (:func:`lightning_gpipe.engine.schedule.zero_bubble_1p`,
:func:`~lightning_gpipe.engine.schedule.zero_bubble_v`) place their W by the stages' costs (:func:`action_costs`);
ZB-V's two model chunks per process are placed in a V (:func:`lightning_gpipe.engine.actions.virtual_stage`), and
so are those of the memory-controllable V schedules ``"v-min"``, ``"v-half"`` and ``"v-zb"``
(:func:`lightning_gpipe.engine.schedule.v_min`), which also place by cost.
Dependencies and recomputes are as above.

With K equal stages, M micro-batches and only forward and backward, the step takes ``(M + K - 1)`` micro-batch
forward-and-backward times under fill-drain and 1F1B, and every stage idles ``(K - 1) / (M + K - 1)`` of it: the
bubble. With B and W apart (``StageCost.weight``), ZB-H1's step is ``M (F + B + W) + (K - 1)(F + B - W)``.

Memory follows :func:`lightning_gpipe.engine.events.peak_activation_bytes`: a stage keeps a micro-batch's input until
its backward, and its saved activations from its forward (or recompute) to its backward. Under fill-drain a stage
holds all M micro-batches: ``checkpoint="never"`` peaks at ``M * (input + activations)``, the other modes at
``M * input + activations``. Under 1F1B stage k holds ``h = min(K - k, M)``: ``h * (input + activations)``,
``h * input + activations`` (``"always"``), and ``h * input + min(h, 2) * activations`` (``"except_last"``,
whose last micro-batch keeps its activations while the earlier ones are recomputed). Under ZB-H1 stage k also holds
the graphs of the ``k`` micro-batches whose W it holds back: ``K * (input + activations)`` on every stage with
``checkpoint="never"`` (1F1B's peak, on stage 0), ``K * input + (k + 1) * activations`` with ``"always"``.

The prediction is a :class:`lightning_gpipe.engine.trace.StepTrace`, like a measured step, so it can be drawn and
compared span by span.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from lightning_gpipe.engine import (
    CHECKPOINT_MODES,
    COMPUTE,
    DEFERRED_BY_DEFAULT,
    SCHEDULES,
    Action,
    ActionCost,
    Clock,
    Kind,
    Span,
    StageTrace,
    StepTrace,
    checkpointed,
    plans,
)
from lightning_gpipe.planning.balance.costs import LayerCost


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage for one micro-batch.

    Args:
        forward: forward time in seconds.
        backward: backward time in seconds (without recompute), weight gradient included.
        recompute: time of a checkpointed micro-batch's recompute in seconds; ``None`` (default): ``forward``.
        input_bytes: bytes of the stage's input (kept until the backward).
        activation_bytes: bytes autograd saves for the backward.
        output_bytes: bytes sent to the next stage (and received back as its gradient).
        weight: of ``backward``, the seconds of the weight gradient when it is deferred until the input gradient
            is sent (``GPipeStrategy(defer_weight_grad=True)``); 0 (default): sent after the whole backward.
    """

    forward: float
    backward: float
    recompute: float | None = None
    input_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0
    weight: float = 0.0


@dataclass(frozen=True)
class Transfer:
    """Time to move ``n`` bytes between neighbouring stages: ``latency + n / bandwidth``.

    Args:
        latency: seconds per message (default 0).
        bandwidth: bytes per second (default infinite).
    """

    latency: float = 0.0
    bandwidth: float = math.inf

    def time(self, nbytes: int) -> float:
        """Seconds to send ``nbytes``."""
        return self.latency + nbytes / self.bandwidth


@dataclass
class Prediction:
    """What :func:`simulate` predicts for one step.

    Args:
        step_time: seconds from the first forward to the last optimizer step's end.
        bubble: mean idle share of the stages (see :attr:`lightning_gpipe.engine.trace.StepTrace.bubble`).
        peak_activation_bytes: per stage, the peak bytes of kept inputs and saved activations.
        trace: the predicted spans, on a clock starting at 0.
    """

    step_time: float
    bubble: float
    peak_activation_bytes: list[int]
    trace: StepTrace = field(repr=False)


def stage_costs(costs: Sequence[LayerCost], balance: Sequence[int], input_bytes: int = 0) -> list[StageCost]:
    """Sum per-layer costs into per-stage costs.

    Profiled costs (:mod:`lightning_gpipe.planning.balance.profile`) come from each layer run alone, so a tensor two
    neighbouring layers both save (one layer's saved output, the next one's saved input, as ReLU then
    Linear) is in both layers' ``activation_bytes`` and counted twice here; the callbacks' measurement
    counts each storage once.

    Args:
        costs: one :class:`~lightning_gpipe.planning.balance.costs.LayerCost` per backbone layer, for one micro-batch.
        balance: layers per stage, summing to ``len(costs)``.
        input_bytes: bytes of one micro-batch of the backbone input (the first stage's input).

    Raises:
        ValueError: if ``balance`` does not cover ``costs`` with non-empty stages.
    """
    if sum(balance) != len(costs) or any(n < 1 for n in balance):
        raise ValueError(f"balance={list(balance)} does not split {len(costs)} layers into non-empty stages.")
    stages: list[StageCost] = []
    start = 0
    for count in balance:
        layers = costs[start : start + count]
        start += count
        stages.append(
            StageCost(
                forward=sum(c.forward for c in layers),
                backward=sum(c.backward for c in layers),
                input_bytes=stages[-1].output_bytes if stages else input_bytes,
                activation_bytes=sum(c.activation_bytes for c in layers),
                output_bytes=layers[-1].output_bytes,
            )
        )
    return stages


def simulate(
    stages: Sequence[StageCost],
    micro_batches: int,
    checkpoint: str = "except_last",
    transfer: Transfer = Transfer(),
    loss: float = 0.0,
    optimizer: float | Sequence[float] = 0.0,
    schedule: str = "gpipe",
    defer_weight_grad: bool | None = None,
    virtual_stages: int = 1,
) -> Prediction:
    """Predict one step of the pipeline (see the module docstring for the schedules).

    Args:
        stages: one :class:`StageCost` per (virtual) stage, in pipeline order: K ``= len(stages) / virtual_stages``
            processes, process k running virtual stages k, k + K, ...; from per-layer costs use
            :func:`stage_costs` (with a balance of ``K * virtual_stages`` entries).
        micro_batches: M, micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``, as for ``GPipeStrategy``.
        transfer: the time to move an activation or gradient between stages (default: free).
        loss: seconds of the last stage's head and loss and their backward to the boundary, for the whole
            mini-batch (under 1F1B, ``loss / M`` after each micro-batch's forward).
        optimizer: seconds of the optimizer step, one number for every stage or one per stage.
        schedule: a name of :data:`~lightning_gpipe.engine.schedule.SCHEDULES` (default ``"gpipe"``, fill-drain), as for
            ``GPipeStrategy``; ``"zb-1p"``, ``"zb-v"`` and the V schedules (``"v-min"``, ``"v-half"``, ``"v-zb"``)
            place their actions by these stages' costs.
        defer_weight_grad: whether the stages after the first split their backwards into B and W, as for
            ``GPipeStrategy``; ``None`` (default): when a stage's ``weight`` is set, or the schedule splits by
            default (``"zb-h1"``, ``"zb-1p"``, ``"zb-v"`` and the V schedules).
        virtual_stages: model chunks per process, as for ``GPipeStrategy`` (default 1; 2 for ``"zb-v"`` and the V
            schedules, whose model chunks are placed in a V).

    Raises:
        ValueError: for no stages, ``micro_batches < 1``, an unknown ``checkpoint`` mode or ``schedule``, a zero-bubble
            schedule with ``defer_weight_grad=False``, a V schedule with other than 2 model chunks per process, or a
            number of stages that ``virtual_stages`` does not divide.
    """
    if not stages or micro_batches < 1 or checkpoint not in CHECKPOINT_MODES or schedule not in SCHEDULES:
        raise ValueError(
            f"Cannot simulate {len(stages)} stages, micro_batches={micro_batches}, checkpoint={checkpoint!r},"
            f" schedule={schedule!r}."
        )
    if virtual_stages < 1 or len(stages) % virtual_stages:
        raise ValueError(
            f"Cannot run {len(stages)} stages as virtual_stages={virtual_stages} model chunks per process."
        )
    num_stages = len(stages) // virtual_stages
    optimizers = [optimizer] * num_stages if isinstance(optimizer, (int, float)) else list(optimizer)
    defer = defer_weight_grad
    if defer is None:
        defer = DEFERRED_BY_DEFAULT[schedule] or any(cost.weight for cost in stages)
    placed = action_costs(stages, loss / micro_batches)
    every = plans(schedule, num_stages, micro_batches, checkpoint, defer, virtual_stages, placed)
    orders = [[a for a in plan.actions if a.kind in COMPUTE] for plan in every]
    spans, free = _replay(stages, orders, micro_batches, checkpoint, transfer, loss, every[0].v_shape)
    for k in range(num_stages):
        spans[k].append(Span("optimizer", None, free[k], free[k] + optimizers[k]))
    trace = StepTrace(0, [StageTrace(k, spans[k], 0.0, spans[k][-1].end) for k in range(num_stages)])
    return Prediction(trace.wall, trace.bubble, [s.peak_activation_bytes for s in trace.stages], trace)


def action_costs(stages: Sequence[StageCost], loss: float = 0.0) -> tuple[ActionCost, ...]:
    """The costs a schedule placed by cost (``"zb-1p"``) takes, from per-(virtual-)stage costs: F, B (the backward
    without its ``weight``) and W, and ``loss`` seconds per micro-batch on the last stage."""
    placed = [ActionCost(cost.forward, cost.backward - cost.weight, cost.weight) for cost in stages]
    placed[-1] = replace(placed[-1], loss=loss)
    return tuple(placed)


def _replay(
    stages: Sequence[StageCost],
    orders: list[list[Action]],
    micro_batches: int,
    checkpoint: str,
    transfer: Transfer,
    loss: float,
    v_shape: bool = False,
) -> tuple[list[list[Span]], list[float]]:
    """Run each process's compute actions (``orders``) on the plans' clock (:class:`~lightning_gpipe.engine.clock.
    Clock`, an activation or gradient taking ``transfer``'s time for its bytes); returns each process's spans and
    when each is free again (the arguments are :func:`simulate`'s; ``stages`` has one cost per virtual stage)."""
    num_stages = len(orders)

    def latency(kind: Kind, s: int) -> float:  # an activation from s - 1, or a gradient of s's output from s + 1
        return transfer.time(stages[s - 1].output_bytes if kind is Kind.FORWARD else stages[s].output_bytes)

    clock = Clock(num_stages, len(stages), v_shape, latency)
    splits = {clock.virtual(k, a.model_chunk) for k, order in enumerate(orders) for a in order if a.kind is Kind.WEIGHT}
    spans: list[list[Span]] = [[] for _ in orders]
    done = [0] * num_stages  # how much of its order each process has run
    progressed = True
    while progressed:
        progressed = False
        for k, order in enumerate(orders):
            while done[k] < len(order):
                action = order[done[k]]
                kind, i, model_chunk = action.kind, action.micro_batch, action.model_chunk
                if (at := clock.arrival(k, kind, i, model_chunk)) is None:
                    break
                s = clock.virtual(k, model_chunk)
                cost = stages[s]
                if kind is not Kind.WEIGHT or cost.weight:  # a stage that does not split its backwards has no W
                    seconds, kept, saved = _work(cost, kind.value, i, micro_batches, checkpoint, loss, s in splits)
                    free = clock.free[k]
                    start = clock.run(k, kind, i, model_chunk, seconds, at)
                    if start > free:
                        spans[k].append(Span("recv", i, free, start, model_chunk=model_chunk))
                    spans[k].append(Span(kind.value, i, start, start + seconds, kept, saved, model_chunk))
                done[k] += 1
                progressed = True
    assert done == [len(order) for order in orders], "a schedule whose stages wait for each other"
    return spans, clock.free


def _work(
    cost: StageCost, kind: str, i: int | None, micro_batches: int, checkpoint: str, loss: float, split: bool
) -> tuple[float, int, int]:
    """Seconds, bytes of input kept and bytes of activations saved of one stage's ``kind`` of micro-batch ``i``
    (``split``: whether the stage's backwards leave the weight gradient to a W action of its own)."""
    if kind == "forward":
        assert i is not None  # a forward is of one micro-batch
        kept = 0 if checkpointed(checkpoint, i, micro_batches) else cost.activation_bytes
        return cost.forward, cost.input_bytes, kept
    if kind == "loss":
        return loss if i is None else loss / micro_batches, 0, 0
    if kind == "recompute":
        return cost.forward if cost.recompute is None else cost.recompute, 0, cost.activation_bytes
    if kind == "backward":
        return cost.backward - cost.weight * split, 0, 0
    return cost.weight, 0, 0
