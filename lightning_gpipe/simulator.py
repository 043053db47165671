"""Predict one GPipe training step from per-layer costs: step time, bubble and peak activation memory per stage.

The schedule is GPipe's fill-drain (Huang et al. 2019, section 2.2 and Figure 2), as
:class:`lightning_gpipe.schedule.GPipe` runs it:

- Fill: stage k runs the forward of micro-batches 0 .. M-1 in order; micro-batch i starts once stage k is
  free and its input has arrived from stage k-1 (the forward's end there plus the transfer time).
- The last stage then runs the user's head and loss and their backward to the boundary (``loss``).
- Drain: every stage runs micro-batches M-1 .. 0. A checkpointed micro-batch's forward is recomputed
  first, *before* the stage waits for its gradient; its backward starts once the gradient has arrived
  from stage k+1 (that stage's backward end plus the transfer time).
- Each stage ends with its optimizer step (``optimizer``).

With K equal stages, M micro-batches and only forward and backward, the step takes ``(M + K - 1)`` micro-batch
forward-and-backward times and every stage idles ``(K - 1) / (M + K - 1)`` of it: the bubble.

Memory follows :func:`lightning_gpipe.events.peak_activation_bytes`: a stage keeps every micro-batch's input until
its backward, and a micro-batch's saved activations from its forward (or recompute) to its backward, so
``checkpoint="never"`` peaks at ``M * (input + activations)`` and the other modes at ``M * input + activations``.

The prediction is a :class:`lightning_gpipe.trace.StepTrace`, like a measured step, so it can be drawn and
compared span by span.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_gpipe.balance.costs import LayerCost
from lightning_gpipe.events import Span
from lightning_gpipe.rematerialization import CHECKPOINT_MODES, checkpointed
from lightning_gpipe.trace import StageTrace, StepTrace


@dataclass(frozen=True)
class StageCost:
    """Cost of one stage for one micro-batch.

    Args:
        forward: forward time in seconds.
        backward: backward time in seconds (without recompute).
        recompute: time of a checkpointed micro-batch's recompute in seconds; ``None`` (default): ``forward``.
        input_bytes: bytes of the stage's input (kept until the backward).
        activation_bytes: bytes autograd saves for the backward.
        output_bytes: bytes sent to the next stage (and received back as its gradient).
    """

    forward: float
    backward: float
    recompute: float | None = None
    input_bytes: int = 0
    activation_bytes: int = 0
    output_bytes: int = 0


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
        bubble: mean idle share of the stages (see :attr:`lightning_gpipe.trace.StepTrace.bubble`).
        peak_activation_bytes: per stage, the peak bytes of kept inputs and saved activations.
        trace: the predicted spans, on a clock starting at 0.
    """

    step_time: float
    bubble: float
    peak_activation_bytes: list[int]
    trace: StepTrace = field(repr=False)


def stage_costs(costs: Sequence[LayerCost], balance: Sequence[int], input_bytes: int = 0) -> list[StageCost]:
    """Sum per-layer costs into per-stage costs.

    Profiled costs (:mod:`lightning_gpipe.balance.profile`) come from each layer run alone, so a tensor two
    neighbouring layers both save (one layer's saved output, the next one's saved input, as ReLU then
    Linear) is in both layers' ``activation_bytes`` and counted twice here; the callbacks' measurement
    counts each storage once.

    Args:
        costs: one :class:`~lightning_gpipe.balance.costs.LayerCost` per backbone layer, for one micro-batch.
        balance: layers per stage, summing to ``len(costs)``.
        input_bytes: bytes of one micro-batch of the backbone input (the first stage's input).

    Raises:
        ValueError: if ``balance`` does not cover ``costs`` with non-empty stages.
    """
    if sum(balance) != len(costs) or any(n < 1 for n in balance):
        raise ValueError(f"balance={list(balance)} does not split {len(costs)} layers into non-empty stages.")
    stages, start = [], 0
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
    chunks: int,
    checkpoint: str = "except_last",
    transfer: Transfer = Transfer(),
    loss: float = 0.0,
    optimizer: float | Sequence[float] = 0.0,
) -> Prediction:
    """Predict one GPipe step (see the module docstring for the schedule).

    Args:
        stages: one :class:`StageCost` per stage (K = ``len(stages)``); from per-layer costs use :func:`stage_costs`.
        chunks: M, micro-batches per mini-batch.
        checkpoint: ``"always"``, ``"except_last"`` (default) or ``"never"``, as for ``GPipeStrategy``.
        transfer: the time to move an activation or gradient between stages (default: free).
        loss: seconds the last stage spends between its fill and its drain (head, loss and their backward).
        optimizer: seconds of the optimizer step, one number for every stage or one per stage.

    Raises:
        ValueError: for no stages, ``chunks < 1`` or an unknown ``checkpoint`` mode.
    """
    if not stages or chunks < 1 or checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"Cannot simulate {len(stages)} stages, chunks={chunks}, checkpoint={checkpoint!r}.")
    num_stages = len(stages)
    optimizers = [optimizer] * num_stages if isinstance(optimizer, (int, float)) else list(optimizer)
    spans: list[list[Span]] = [[] for _ in stages]
    free = [0.0] * num_stages  # when each stage is next free
    arrivals = [0.0] * chunks  # when micro-batch i's input reaches the current stage
    for k, cost in enumerate(stages):  # the fill
        for i in range(chunks):
            kept = 0 if checkpointed(checkpoint, i, chunks) else cost.activation_bytes
            free[k] = _run(spans[k], free[k], arrivals[i], cost.forward, "forward", i, cost.input_bytes, kept)
            arrivals[i] = free[k] + transfer.time(cost.output_bytes)
    last = num_stages - 1
    spans[last].append(Span("loss", None, free[last], free[last] + loss))
    free[last] += loss
    arrivals = [free[last]] * chunks  # when micro-batch i's output gradient reaches the current stage
    for k in range(last, -1, -1):  # the drain
        cost = stages[k]
        for i in range(chunks - 1, -1, -1):
            if checkpointed(checkpoint, i, chunks):
                recompute = cost.forward if cost.recompute is None else cost.recompute
                free[k] = _run(spans[k], free[k], free[k], recompute, "recompute", i, 0, cost.activation_bytes)
            free[k] = _run(spans[k], free[k], arrivals[i], cost.backward, "backward", i)
            if k > 0:
                arrivals[i] = free[k] + transfer.time(stages[k - 1].output_bytes)
        spans[k].append(Span("optimizer", None, free[k], free[k] + optimizers[k]))
        free[k] += optimizers[k]
    trace = StepTrace(0, [StageTrace(k, spans[k], 0.0, free[k]) for k in range(num_stages)])
    return Prediction(trace.wall, trace.bubble, [s.peak_activation_bytes for s in trace.stages], trace)


def _run(
    spans: list[Span], free: float, ready: float, seconds: float, kind: str, i: int, kept: int = 0, saved: int = 0
) -> float:
    """Append a wait (``recv``) until ``ready`` if the stage is free before, then the work; return its end."""
    start = max(free, ready)
    if start > free:
        spans.append(Span("recv", i, free, start))
    spans.append(Span(kind, i, start, start + seconds, kept, saved))
    return start + seconds
