"""Pipeline schedules as data: each stage's ordered actions for one training step.

A schedule is a function of (pipeline rank k, K stages, M micro-batches, checkpoint mode, deferred weight
gradients) that returns one :class:`Plan` per stage: the stage's :class:`Action` list, in the order the stage runs
it, and where its backward phase begins (the pipeline's ``backward`` call runs it). One runtime executes a plan over
a stage's primitives (:class:`lightning_gpipe.engine.pipeline.Runtime`); the simulator
(:mod:`lightning_gpipe.planning.simulator`) times the same lists, and :func:`check` runs them abstractly before the
first step, so a schedule whose sends and receives do not pair up, or whose stages would wait for each other, is an
error rather than a hang. A new schedule is one more function in :data:`SCHEDULES`.

The vocabulary (:class:`Kind`, :class:`Action`, :class:`Plan`) is :mod:`lightning_gpipe.engine.actions`'s, importable
from here too; ``"zb-1p"`` places its weight gradients with :mod:`lightning_gpipe.engine.placement`.
"""

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_gpipe.engine.actions import (
    Action,
    ActionCost,
    Kind,
    Plan,
    splits_backward,
    stage_of_virtual,
    virtual_stage,
)
from lightning_gpipe.engine.clock import Clock, needs
from lightning_gpipe.engine.placement import place_weights
from lightning_gpipe.engine.rematerialization import checkpointed

ScheduleFunction = Callable[[int, int, int, str, bool, int, tuple[ActionCost, ...] | None], Plan]
"""``schedule(stage_index, num_stages, micro_batches, checkpoint, defer_weight_grad, virtual_stages, costs) -> Plan``;
``costs`` (one :class:`ActionCost` per virtual stage, or ``None``) matter only to the schedules that place actions
by cost."""


class ScheduleError(ValueError):
    """Raised by :func:`check` for plans whose transfers do not pair up or whose stages would wait for each other."""


def weights_after_drain(is_last: bool, checkpoint: str) -> bool:
    """Whether fill-drain runs a stage's deferred weight gradients (W) after its whole drain, not after each B.

    The last stage waits for no gradient, so every W it runs before its next B delays the previous stage by
    that W. With ``checkpoint="never"`` it holds every micro-batch's graph at the end of the fill anyway, so
    running all B first and all W after them (zero-bubble's placement of W where nothing waits for it, Qi et
    al. 2023, section 3) raises no peak but that of the kept gradients at the layers (about one activation per
    layer with parameters and micro-batch). With re-materialization the recomputed graphs would pile up
    instead, so there, and on the other stages (which wait for gradients), W follows each B.

    Args:
        is_last: whether the stage is the pipeline's last.
        checkpoint: the re-materialization mode (:data:`lightning_gpipe.engine.rematerialization.CHECKPOINT_MODES`).
    """
    return is_last and checkpoint == "never"


@dataclass(frozen=True)
class _Chunks:
    """The model chunks (virtual stages) of pipeline rank ``stage_index``: model chunk ``c`` is virtual stage
    ``c * K + stage_index`` of ``K * v`` (process k holds virtual stages k, k + K, ...; Narayanan et al. 2021,
    section 2.2), or placed in a V (:func:`~lightning_gpipe.engine.actions.virtual_stage`)."""

    stage_index: int
    num_stages: int
    virtual_stages: int
    v_shape: bool = False

    def virtual(self, model_chunk: int) -> int:
        """The virtual stage of ``model_chunk``."""
        return virtual_stage(self.stage_index, model_chunk, self.num_stages, self.v_shape)

    def is_last(self, model_chunk: int) -> bool:
        """Whether ``model_chunk`` is the pipeline's last virtual stage (where the user's head and loss follow)."""
        return self.virtual(model_chunk) == self.num_stages * self.virtual_stages - 1


def _fill(place: _Chunks, micro_batches: int) -> list[Action]:
    """Fill-drain's fill on one stage: each model chunk's forwards of all ``micro_batches`` micro-batches in turn, each
    sent on."""
    fill = []
    for c in range(place.virtual_stages):
        for i in range(micro_batches):
            fill += [Action(Kind.FORWARD, i, c)] + [Action(Kind.SEND, i, c)] * (not place.is_last(c))
    return fill


def _after_forward(place: _Chunks, i: int, c: int) -> list[Action]:
    """What follows forward ``i`` on model chunk ``c`` in a schedule with a loss per micro-batch: the loss on the last
    virtual stage, else the send and, at once, the receive of its gradient."""
    if place.is_last(c):
        return [Action(Kind.LOSS, i, c)]
    return [Action(Kind.SEND, i, c), Action(Kind.EXPECT, i, c)]


def _backward(i: int, c: int, checkpoint: str, micro_batches: int) -> list[Action]:
    """Backward ``i`` on model chunk ``c``, after its recompute if ``checkpoint`` re-materializes it."""
    return [Action(Kind.RECOMPUTE, i, c)] * checkpointed(checkpoint, i, micro_batches) + [Action(Kind.BACKWARD, i, c)]


def gpipe(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 1,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """GPipe's fill-drain (Huang et al. 2019, section 2.2 and Figure 2); with ``virtual_stages`` v > 1 the looped
    fill-drain of interleaved pipelines (Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism", section 3;
    torch's ``ScheduleLoopedBFS``).

    Fill (``training_step``): every micro-batch runs forward and is sent on, one model chunk after the other (all
    micro-batches of a stage's first model chunk, then of its second, ...). Drain (``backward``), after the user's loss
    on the whole mini-batch: the micro-batches run backward in reverse order, the last model chunk first. A checkpointed
    micro-batch is recomputed *before* the stage waits for its gradient, so the recompute overlaps the next stage's
    backward of the same micro-batch. Every gradient's receive is posted as the drain starts: gloo moves a payload
    only once its receive is posted, so a receive posted after the send costs a round trip between the two stages'
    transport threads; the stage then holds M
    gradient buffers, which :func:`lightning_gpipe.planning.held.held_peak` counts. With
    deferred weight gradients each W follows its B, except on the last stage without re-materialization and
    virtual stages, which runs every W after its last B (:func:`weights_after_drain`; with virtual stages every
    plan ends with its first model chunk's last backward, where the data-parallel gradient sync starts). With v model
    chunks of ``1 / v`` of a stage's layers each, the bubble falls from ``(K - 1) / (M + K - 1)`` towards
    ``(K - 1) / (v M + K - 1)`` when M >= K; every stage still holds all M micro-batches.
    """
    place = _Chunks(stage_index, num_stages, virtual_stages)
    fill = _fill(place, micro_batches)
    order = [(i, c) for c in reversed(range(virtual_stages)) for i in reversed(range(micro_batches))]
    last_process = stage_index == num_stages - 1
    drain = [Action(Kind.LOSS)] * last_process + [Action(Kind.EXPECT, i, c) for i, c in order]
    at_end = []
    for i, c in order:
        split = splits_backward(place.virtual(c), defer_weight_grad)
        drain += [Action(Kind.RECOMPUTE, i, c)] * checkpointed(
            checkpoint, i, micro_batches
        )  # before waiting for the gradient
        drain.append(Action(Kind.BACKWARD, i, c))
        weight = [Action(Kind.WEIGHT, i, c)] * split
        if virtual_stages == 1 and weights_after_drain(place.is_last(c), checkpoint):
            at_end += weight
        else:
            drain += weight
    return Plan(tuple(fill + drain + at_end + [Action(Kind.FLUSH)]), backward_from=len(fill))


def one_f_one_b(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 1,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """The 1F1B schedule of PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
    Training", section 3; the default of Megatron-LM, DeepSpeed and torchtitan); with ``virtual_stages`` v > 1
    Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
    Clusters", section 2.2; torch's ``ScheduleInterleaved1F1B``).

    Stage k of K runs ``min(K - k - 1, M)`` warm-up forwards, then alternates one forward and one backward
    (forward ``i`` is followed by the backward of micro-batch ``i - (K - k - 1)``), then the remaining backwards.
    Micro-batch i's backward starts as soon as its loss exists (the last stage runs the user's step per
    micro-batch), so stage k holds at most ``min(K - k, M)`` micro-batches instead of GPipe's M; same gradients,
    and with equal stages the same bubble, ``(K - 1) / (M + K - 1)``. Each gradient's receive is posted right after
    the micro-batch's activation is sent. The stage waits for its sends only at the end of the step: it drops each
    one that has completed when it posts the next (:class:`~lightning_gpipe.engine.transfer.Link`), so a sent tensor
    is freed with its micro-batch all the same. The whole plan runs in ``training_step``. With deferred weight
    gradients each W follows its B.

    Interleaved (v > 1): the micro-batches go in groups of K; a stage runs a group's forwards on its first model chunk,
    then on its second, ..., and the backwards of a group from its last model chunk down, after
    ``2 (K - k - 1) + (v - 1) K`` warm-up forwards (Megatron-LM's count). The bubble falls towards
    ``(K - 1) / (v M + K - 1)``; a stage holds up to about ``v`` times as many micro-batches of ``1 / v`` of its
    layers as 1F1B, plus the warm-up's. M need not be a multiple of K: the last group is smaller, and where
    Megatron-LM's warm-up would then leave the stages waiting for each other, every stage runs the fewest more
    warm-up forwards that let the plans run (:func:`check`; all forwards first always does).
    """
    return _one_forward_one_backward(
        stage_index, num_stages, micro_batches, checkpoint, defer_weight_grad, delay=0, virtual_stages=virtual_stages
    )


def zero_bubble_h1(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 1,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """ZB-H1, the zero-bubble schedule of Qi et al. 2023 ("Zero Bubble Pipeline Parallelism", arXiv:2401.10241,
    section 3.1, Figure 3), with a fixed placement of the weight gradients.

    1F1B's order of forwards and input gradients (B, see :func:`one_f_one_b`), each backward split into B and W;
    stage k of K runs the W of micro-batch ``j`` after the B of micro-batch ``j + k`` (in the steady phase, just
    before its next forward; the last k W after its last B). A stage's B thus reaches the previous stage without
    the stage's own W in between, and the W fill the time the stage would otherwise wait for the next gradient or
    activation: the later a stage, the longer the previous ones keep it waiting at the end of the step, the more W
    it holds back. Stage k then holds at most ``K - k`` micro-batches waiting for B plus ``k`` waiting for W, K in
    all, which is 1F1B's peak (on stage 0): the paper's "same memory as 1F1B". With equal stages of F, B and W
    seconds the step is ``M (F + B + W) + (K - 1)(F + B - W)`` (the paper's bubble ``(K - 1)(F + B - W)`` against
    1F1B's ``(K - 1)(F + B + W)``). The placement is fixed (the paper's handcrafted ZB-H1), not searched from
    measured costs (its automatic scheduler, section 3.2, is ``"zb-1p"``: :func:`zero_bubble_1p`; ``costs`` are
    unused here). The first stage sends no input gradient, so its
    backwards stay whole (its W follows its B, as ZB-H1 places it).

    With ``virtual_stages`` v > 1: interleaved 1F1B's order (:func:`one_f_one_b`) with the same fixed delay, each
    W ``k`` backwards after its B (of any model chunk). This is our extension, not the paper's: torch's
    ``ScheduleInterleavedZeroBubble`` places W by a greedy search instead.

    Raises:
        ValueError: without ``defer_weight_grad``: the schedule places W apart from B, so it needs the split.
    """
    _need_split("zb-h1", defer_weight_grad)
    return _one_forward_one_backward(
        stage_index, num_stages, micro_batches, checkpoint, True, delay=stage_index, virtual_stages=virtual_stages
    )


def _need_split(schedule: str, defer_weight_grad: bool) -> None:
    """Raise ValueError, naming ``schedule``, if it is to run without the B/W split."""
    if not defer_weight_grad:
        raise ValueError(
            f"schedule {schedule!r} runs each weight gradient apart from its input gradient: it needs the B/W"
            " split (defer_weight_grad=True)."
        )


def _one_forward_one_backward(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer: bool,
    delay: int,
    virtual_stages: int = 1,
    extra_warmup: int | None = None,
) -> Plan:
    """1F1B's order (:func:`one_f_one_b`), each deferred W run after the B ``delay`` backwards later; interleaved
    with ``extra_warmup`` more warm-up forwards than Megatron-LM's (``None``: :func:`_extra_warmup`'s)."""
    place = _Chunks(stage_index, num_stages, virtual_stages)
    groups = [range(g, min(g + num_stages, micro_batches)) for g in range(0, micro_batches, num_stages)]
    forwards = [(i, c) for group in groups for c in range(virtual_stages) for i in group]
    backwards = [(i, c) for group in groups for c in reversed(range(virtual_stages)) for i in group]
    warmup = num_stages - 1 - stage_index
    if virtual_stages > 1:
        if extra_warmup is None:
            extra_warmup = _extra_warmup(num_stages, micro_batches, virtual_stages)
        warmup = 2 * warmup + (virtual_stages - 1) * num_stages + extra_warmup
    warmup = min(warmup, len(forwards))
    actions: list[Action] = []

    def backward(n: int) -> None:
        actions.extend(_backward(*backwards[n], checkpoint, micro_batches))
        if n >= delay:
            actions.extend(weight(*backwards[n - delay]))

    def weight(i: int, c: int) -> list[Action]:
        return [Action(Kind.WEIGHT, i, c)] * splits_backward(place.virtual(c), defer)

    for n, (i, c) in enumerate(forwards):
        actions += [Action(Kind.FORWARD, i, c)] + _after_forward(place, i, c)
        if n >= warmup:
            backward(n - warmup)
    for n in range(len(forwards) - warmup, len(forwards)):
        backward(n)
    for n in range(max(len(backwards) - delay, 0), len(backwards)):
        actions.extend(weight(*backwards[n]))
    actions.append(Action(Kind.FLUSH))
    return Plan(tuple(actions), backward_from=len(actions), loss_per_micro_batch=True)


@functools.cache
def _extra_warmup(num_stages: int, micro_batches: int, virtual_stages: int) -> int:
    """The fewest warm-up forwards to add to Megatron-LM's on every stage so that interleaved 1F1B's plans of
    ``micro_batches`` micro-batches run to their end (0 when M is a multiple of K; the order of transfers alone decides,
    so plans without re-materialization or W stand for all)."""
    for extra in range(micro_batches * virtual_stages):
        candidate = [
            _one_forward_one_backward(k, num_stages, micro_batches, "never", False, 0, virtual_stages, extra)
            for k in range(num_stages)
        ]
        try:
            check(candidate)
            return extra
        except ScheduleError:
            continue
    return micro_batches * virtual_stages  # every forward first: the order of the looped fill-drain, which always runs


def zero_bubble_1p(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 1,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """ZB-1p, zero-bubble's automatic schedule at 1F1B's memory (Qi et al. 2023, arXiv:2401.10241, section 3.2,
    its heuristic algorithm): 1F1B's order of forwards and input gradients (B, :func:`one_f_one_b`, interleaved
    with ``virtual_stages`` v > 1), each weight gradient W placed from the actions' costs on a clock of the stages'
    plans (:func:`~lightning_gpipe.engine.placement.place_weights`), ZB-H1's fixed placement (:func:`zero_bubble_h1`)
    among
    the candidates: never slower than ZB-H1's on that clock, and with one model chunk per stage and equal costs ZB-H1's.
    W are local, so only where a stage's W go depends on the costs: every stage's transfers are 1F1B's whatever the
    costs, and stages that placed from different costs still pair up.

    Args:
        costs: one :class:`ActionCost` per virtual stage, in pipeline order; ``None`` (default): equal F, B and W
            everywhere.

    Raises:
        ValueError: without ``defer_weight_grad`` (the schedule places W apart from B), or with another number
            of costs than virtual stages.
    """
    _need_split("zb-1p", defer_weight_grad)
    num_virtual = num_stages * virtual_stages
    if costs is not None and len(costs) != num_virtual:
        raise ValueError(f"schedule 'zb-1p' takes one cost per virtual stage: {num_virtual}, not {len(costs)}.")
    return _placed(num_stages, micro_batches, checkpoint, virtual_stages, costs or (ActionCost(),) * num_virtual)[
        stage_index
    ]


@functools.lru_cache(maxsize=64)
def _placed(
    num_stages: int, micro_batches: int, checkpoint: str, virtual_stages: int, costs: tuple[ActionCost, ...]
) -> tuple[Plan, ...]:
    """Every stage's ZB-1p plan (:func:`zero_bubble_1p`): 1F1B's plans with their W placed by ``costs``."""
    base = [
        _one_forward_one_backward(k, num_stages, micro_batches, checkpoint, False, 0, virtual_stages)
        for k in range(num_stages)
    ]
    fixed = [
        _one_forward_one_backward(k, num_stages, micro_batches, checkpoint, True, k, virtual_stages)
        for k in range(num_stages)
    ]
    return place_weights(base, costs, alternatives=[fixed])


def zero_bubble_v(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 2,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """ZB-V (Qi et al. 2023, arXiv:2401.10241, section 6): two model chunks per stage placed in a V, virtual stages
    k and 2K - 1 - k on stage k (:func:`~lightning_gpipe.engine.actions.virtual_stage`). A micro-batch goes through the
    stages and back, turning on stage K - 1 (within the process: a :class:`~lightning_gpipe.engine.transfer.Turn`), so
    the pipeline's first and last virtual stages, the backbone input and the user's head and loss, are both on stage 0,
    and the last virtual stage's backward starts on the stage that starts the next forward.

    Each stage's forwards and input gradients B are ordered on a clock of the actions' costs (:func:`_v_order`),
    then every weight gradient W is placed by cost as ``"zb-1p"`` places it (:func:`~lightning_gpipe.engine.placement.
    place_weights`): a W fills a wait or frees memory. Our construction from the paper's shape, not its schedule
    figure: the order is the clock's greedy one, where a stage takes in a new micro-batch (its first model chunk's
    forward) only while it holds fewer than 2K micro-batches of a model chunk (1F1B's peak on its first stage, K
    micro-batches of a whole stage, with model chunks of half a stage).

    Args:
        virtual_stages: must be 2 (the V's two arms).
        costs: one :class:`ActionCost` per virtual stage, in pipeline order; ``None`` (default): equal F, B and W.

    Raises:
        ValueError: without ``defer_weight_grad``, with ``virtual_stages`` other than 2, or with another number of
            costs than virtual stages.
    """
    placed = _v_costs("zb-v", num_stages, defer_weight_grad, virtual_stages, costs)
    return _v_placed(num_stages, micro_batches, checkpoint, placed)[stage_index]


def _v_costs(
    schedule: str, num_stages: int, defer_weight_grad: bool, virtual_stages: int, costs: tuple[ActionCost, ...] | None
) -> tuple[ActionCost, ...]:
    """The costs a V-shaped ``schedule`` places its plans by (equal ones for ``None``), after checking that it runs
    with the B/W split, two model chunks per stage and one cost per virtual stage (ValueError, naming ``schedule``)."""
    _need_split(schedule, defer_weight_grad)
    if virtual_stages != 2:
        raise ValueError(
            f"schedule {schedule!r} places two model chunks per stage in a V: it needs virtual_stages=2, not"
            f" {virtual_stages}."
        )
    if costs is not None and len(costs) != 2 * num_stages:
        raise ValueError(f"schedule {schedule!r} takes one cost per virtual stage: {2 * num_stages}, not {len(costs)}.")
    return costs or (ActionCost(),) * (2 * num_stages)


@functools.lru_cache(maxsize=64)
def _v_placed(
    num_stages: int, micro_batches: int, checkpoint: str, costs: tuple[ActionCost, ...], limit: int | None = None
) -> tuple[Plan, ...]:
    """Every stage's ZB-V plan (:func:`zero_bubble_v`), or with a stage's memory held within ``limit``
    (:func:`v_min`, :func:`v_half`, :func:`v_zb`)."""
    return place_weights(_v_order(num_stages, micro_batches, checkpoint, costs, limit), costs)


V_MEMORY: dict[str, tuple[int, int]] = {"v-min": (2, 3), "v-half": (1, 1), "v-zb": (2, 1)}
"""The memory-controllable V schedules (Qi et al. 2024): the most micro-batches of a model chunk (half a stage's
layers) each stage holds at once, as a fraction ``(a, b)`` of K: ``ceil(a K / b)`` of them, and at least 2
(:func:`held_limit`)."""


def held_limit(schedule: str, num_stages: int) -> int:
    """The most model-chunk micro-batches one stage of the V schedule ``schedule`` (a key of :data:`V_MEMORY`) holds
    between their forward and their weight gradient W on ``num_stages`` stages: ``ceil(2K / 3)`` for ``"v-min"``,
    ``K`` for ``"v-half"`` and ``2K`` for ``"v-zb"``, at least 2 (one micro-batch on both of a stage's model chunks,
    where it turns). Against 1F1B's K micro-batches of a whole stage (2K of a model chunk): a third, a half, the same.

    Raises:
        KeyError: for a schedule that is not one of :data:`V_MEMORY`.
    """
    share, of = V_MEMORY[schedule]
    return max(2, -(-share * num_stages // of))


def _v_controlled(
    schedule: str,
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int,
    costs: tuple[ActionCost, ...] | None,
) -> Plan:
    """Stage ``stage_index``'s plan of the memory-controllable V schedule ``schedule`` (:func:`v_min`)."""
    placed = _v_costs(schedule, num_stages, defer_weight_grad, virtual_stages, costs)
    limit = held_limit(schedule, num_stages)
    return _v_placed(num_stages, micro_batches, checkpoint, placed, limit)[stage_index]


def v_min(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 2,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """V-Min (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv:2405.15362, section 4): ZB-V's
    V (:func:`zero_bubble_v`: two model chunks per stage, virtual stages k and 2K - 1 - k on stage k, the head on
    stage 0, the B/W split) with each stage holding at most ``ceil(2K / 3)`` micro-batches of a model chunk (half a
    stage) between their forward and their W (:func:`held_limit`): about a third of 1F1B's activation memory (K
    micro-batches of a whole stage), at a bubble that grows as the limit tightens.

    The paper repeats a building block whose lifespan sets the memory (its V-Min holds ``(K + 4) // 3`` micro-batches
    of a whole stage). Ours is built from the memory bound instead: the order of ZB-V's clock of the actions' costs
    (:func:`_v_order`), where a stage takes in a new micro-batch (its first model chunk's forward) only if it then
    holds, counting a slot kept for the return of each micro-batch still on its way through the V, at most the limit,
    so no return ever waits for room; then each W placed by cost as ``"zb-1p"`` places it (:func:`~lightning_gpipe.
    engine.placement.place_weights`), which keeps every stage within that peak. Recomputes (``checkpoint``) go right
    before their backward; the plans run in ``training_step`` like 1F1B's.

    Args:
        virtual_stages: must be 2 (the V's two arms).
        costs: one :class:`ActionCost` per virtual stage, in pipeline order; ``None`` (default): equal F, B and W.

    Raises:
        ValueError: without ``defer_weight_grad``, with ``virtual_stages`` other than 2, or with another number of
            costs than virtual stages.
    """
    args = (stage_index, num_stages, micro_batches, checkpoint, defer_weight_grad, virtual_stages, costs)
    return _v_controlled("v-min", *args)


def v_half(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 2,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """V-Half (Qi et al. 2024, arXiv:2405.15362, section 4): :func:`v_min`'s construction with each stage holding at
    most K micro-batches of a model chunk, half of 1F1B's activation memory (the paper's V-Half holds
    ``(K + 2) // 2`` of a whole stage), with a smaller bubble than V-Min's. Arguments and errors as :func:`v_min`'s."""
    args = (stage_index, num_stages, micro_batches, checkpoint, defer_weight_grad, virtual_stages, costs)
    return _v_controlled("v-half", *args)


def v_zb(
    stage_index: int,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool,
    virtual_stages: int = 2,
    costs: tuple[ActionCost, ...] | None = None,
) -> Plan:
    """V-ZB (Qi et al. 2024, arXiv:2405.15362, section 4): :func:`v_min`'s construction with each stage holding at
    most 2K micro-batches of a model chunk, 1F1B's activation memory, for the smallest bubble of the three (near zero
    where F, B and W are about equal, as ZB-V's, :func:`zero_bubble_v`, which admits by a looser count). Arguments
    and errors as :func:`v_min`'s."""
    args = (stage_index, num_stages, micro_batches, checkpoint, defer_weight_grad, virtual_stages, costs)
    return _v_controlled("v-zb", *args)


def _v_order(
    num_stages: int, micro_batches: int, checkpoint: str, costs: Sequence[ActionCost], limit: int | None = None
) -> list[Plan]:
    """Every stage's forwards and backwards in a V (:func:`zero_bubble_v`), in the order a clock of ``costs`` runs
    them, each backward timed as its B alone (its W is to fill a wait; the first virtual stage's backwards stay
    whole): a free stage runs the backward whose gradient is there (the oldest micro-batch first), else a forward
    whose input is there (its second model chunk first, which leads to the loss; its first model chunk, which takes in a
    new micro-batch, only while it holds fewer than 2K micro-batches of a model chunk, or as ``limit`` allows:
    :meth:`_VOrder._admits`), else waits for the next input to arrive.
    Each virtual stage runs its micro-batches in order, so every link's transfers are in order."""
    order = _VOrder(num_stages, micro_batches, costs, limit)
    order.run()
    return [order.plan(k, checkpoint) for k in range(num_stages)]


class _VOrder:
    """The order of :func:`_v_order`, found by running the stages on the plans' one clock
    (:class:`~lightning_gpipe.engine.clock.Clock`): each stage's next forward and backward per model chunk, chosen as
    the docstring of :func:`_v_order` says."""

    def __init__(
        self, num_stages: int, micro_batches: int, costs: Sequence[ActionCost], limit: int | None = None
    ) -> None:
        self.num_stages, self.micro_batches, self.costs, self.limit = num_stages, micro_batches, costs, limit
        self.last = 2 * num_stages - 1
        self.clock = Clock(num_stages, 2 * num_stages, v_shape=True)
        self.forwarded, self.backwarded = [0] * (2 * num_stages), [0] * (2 * num_stages)  # per virtual stage
        # each stage's actions so far: (kind, micro-batch, model chunk)
        self.order: list[list[tuple[Kind, int, int]]] = [[] for _ in range(num_stages)]

    def run(self) -> None:
        """Run every stage's forwards and backwards (two model chunks of M micro-batches each: 4M actions)."""
        while busy := [k for k in range(self.num_stages) if len(self.order[k]) < 4 * self.micro_batches]:
            self._step(busy)

    def _step(self, busy: list[int]) -> None:
        """Run one action on the earliest free stage of ``busy`` that can run one then, or move the waiting stages'
        clocks to the next arrival."""
        free = self.clock.free
        now = min(free[k] for k in busy)
        for k in (k for k in busy if free[k] == now):
            ready = [key for arrival, key in self._candidates(k) if arrival is not None and arrival <= now]
            if ready:
                self._run(k, *min(ready)[1:])
                return
        later = [arrival for k in busy for arrival, _ in self._candidates(k) if arrival is not None and arrival > now]
        later += [free[k] for k in busy if free[k] > now]
        if not later:  # not for a V: a stage's second model chunk, which leads to the loss, always runs
            raise RuntimeError("The stages of the V would wait for each other.")
        for k in busy:
            free[k] = max(free[k], min(later))

    def _candidates(self, k: int) -> list[tuple[float | None, tuple[int, int, int, Kind, int]]]:
        """Stage ``k``'s next actions as ``(arrival, (priority, micro-batch, virtual stage, kind, model chunk))``, the
        arrival of their input ``None`` while it is not computed."""
        found = []
        for model_chunk in (1, 0):
            s = self.clock.virtual(k, model_chunk)
            i = self.backwarded[s]
            if i < self.forwarded[s]:
                found.append(
                    (self.clock.arrival(k, Kind.BACKWARD, i, model_chunk), (0, i, s, Kind.BACKWARD, model_chunk))
                )
            i = self.forwarded[s]
            if i < self.micro_batches and self._admits(k, model_chunk):
                found.append(
                    (
                        self.clock.arrival(k, Kind.FORWARD, i, model_chunk),
                        (2 - model_chunk, i, s, Kind.FORWARD, model_chunk),
                    )
                )
        return found

    def _held(self, k: int) -> int:
        """Chunk micro-batches stage ``k`` has forwarded and not yet backwarded."""
        virtual = [self.clock.virtual(k, model_chunk) for model_chunk in (0, 1)]
        return sum(self.forwarded[s] - self.backwarded[s] for s in virtual)

    def _admits(self, k: int, model_chunk: int) -> bool:
        """Whether stage ``k`` may run a forward of ``model_chunk`` now. ZB-V's rule (``limit`` ``None``): its second
        model chunk's always, its first's (a new micro-batch taken in) while it holds fewer than 2K. With a ``limit``:
        a new micro-batch while it holds fewer than ``limit - 1``, a second model chunk's while fewer than ``limit``:
        the slot kept free lets the return of the oldest micro-batch in flight always run (each virtual stage runs its
        micro-batches in order, so no younger one's return takes it first), and the stage never holds more."""
        if self.limit is None:
            return model_chunk == 1 or self._held(k) < 2 * self.num_stages
        return self._held(k) < self.limit - (model_chunk == 0)

    def _run(self, k: int, i: int, s: int, kind: Kind, model_chunk: int) -> None:
        """Run ``kind`` of micro-batch ``i`` on stage ``k``'s ``model_chunk`` (virtual stage ``s``) now (it is free)."""
        cost = self.costs[s]
        if kind is Kind.FORWARD:
            seconds = cost.forward + (cost.loss if s == self.last else 0.0)
            self.forwarded[s] += 1
        else:
            seconds = cost.backward + (cost.weight if s == 0 else 0.0)  # W goes where the stage would wait
            self.backwarded[s] += 1
        self.clock.run(k, kind, i, model_chunk, seconds, self.clock.free[k])
        self.order[k].append((kind, i, model_chunk))

    def plan(self, k: int, checkpoint: str) -> Plan:
        """Stage ``k``'s plan of the clock's order: each forward sent on (its gradient's receive posted with it) or
        followed by the loss, each backward after its recompute, a flush at the end."""
        place, actions = _Chunks(k, self.num_stages, 2, v_shape=True), []
        for kind, i, model_chunk in self.order[k]:
            if kind is Kind.FORWARD:
                actions += [Action(Kind.FORWARD, i, model_chunk), *_after_forward(place, i, model_chunk)]
            else:
                actions += _backward(i, model_chunk, checkpoint, self.micro_batches)
        actions.append(Action(Kind.FLUSH))
        return Plan(tuple(actions), backward_from=len(actions), loss_per_micro_batch=True, v_shape=True)


SCHEDULES: dict[str, ScheduleFunction] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "zb-1p": zero_bubble_1p,
    "zb-v": zero_bubble_v,
    "v-min": v_min,
    "v-half": v_half,
    "v-zb": v_zb,
}
"""The schedules by the name ``GPipeStrategy(schedule=...)`` takes."""

DEFERRED_BY_DEFAULT: dict[str, bool] = {
    "gpipe": False,
    "1f1b": False,
    **dict.fromkeys(["zb-h1", "zb-1p", "zb-v", *V_MEMORY], True),
}
"""Whether each schedule splits its backwards into B and W when ``GPipeStrategy(defer_weight_grad=None)``."""

PLACED_BY_COST: frozenset[str] = frozenset({"zb-1p", "zb-v", *V_MEMORY})
"""The schedules whose plans depend on the actions' costs (``plans(costs=...)``), for which the strategy profiles
the backbone with its backwards split into B and W."""

V_SHAPED: frozenset[str] = frozenset({"zb-v", *V_MEMORY})
"""The schedules that place each stage's two model chunks in a V
(:func:`~lightning_gpipe.engine.actions.virtual_stage`),
so that the pipeline's last virtual stage, and the user's head, are on stage 0."""


def plans(
    schedule: str,
    num_stages: int,
    micro_batches: int,
    checkpoint: str,
    defer_weight_grad: bool | None = None,
    virtual_stages: int = 1,
    costs: Sequence[ActionCost] | None = None,
) -> list[Plan]:
    """Every stage's plan of one step of ``schedule`` (a name of :data:`SCHEDULES`); ``defer_weight_grad=None``
    (default): the schedule's default, :data:`DEFERRED_BY_DEFAULT`; ``virtual_stages``: model chunks per stage
    (default 1); ``costs``: one :class:`ActionCost` per virtual stage, for ``"zb-1p"`` (default: equal costs).

    Raises:
        ValueError: for an unknown schedule, a zero-bubble schedule with ``defer_weight_grad=False``, or another
            number of costs than virtual stages.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"Unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}.")
    defer = DEFERRED_BY_DEFAULT[schedule] if defer_weight_grad is None else defer_weight_grad
    placed = None if costs is None else tuple(costs)
    function = SCHEDULES[schedule]
    return [
        function(k, num_stages, micro_batches, checkpoint, defer, virtual_stages, placed) for k in range(num_stages)
    ]


def evaluation(num_stages: int, micro_batches: int, virtual_stages: int = 1, v_shape: bool = False) -> list[Plan]:
    """Every stage's plan of an evaluation step, whatever the training schedule: fill-drain's fill (each model chunk's
    forwards of all micro-batches in turn, each sent on), then a flush; ``v_shape``: the model chunks placed in a V
    (:data:`V_SHAPED`)."""
    every = []
    for k in range(num_stages):
        actions = (*_fill(_Chunks(k, num_stages, virtual_stages, v_shape), micro_batches), Action(Kind.FLUSH))
        every.append(Plan(actions, backward_from=len(actions), v_shape=v_shape))
    return every


def check(stage_plans: Sequence[Plan], training: bool = True) -> None:
    """Run the plans of a pipeline's stages abstractly and raise if they could not run to their end.

    Stage k's ``forward i`` needs stage k-1's ``send`` of micro-batch i next on their link (activations arrive in
    send order); its ``backward i`` needs, on every stage but the last, a posted ``expect i`` and stage k+1's
    ``backward i`` next on their link (gradients arrive in the order their receives were posted); a ``flush`` needs
    every activation the stage sent received and every gradient it sent with its receive posted (a send completes
    once its receive is posted); the last stage's ``backward i`` needs its ``loss``. Every stage must run
    each micro-batch's forward and backward once, the recompute (if any) and W (if any) between them. With
    several model chunks per stage the same holds for every virtual stage (model chunk c of stage k is virtual stage
    ``c * K + k``, or as :func:`~lightning_gpipe.engine.actions.virtual_stage` places them in a V), each pair of
    neighbouring virtual stages having a link of its own (within a process too, where a V turns).

    With ``training=False``, plans of forwards only (:func:`evaluation`): no backward is asked for.

    Raises:
        ScheduleError: naming the stage, the action and what it waits for, for a transfer out of order, a missing
            action, or stages that would wait for each other.
    """
    state = _Abstract(stage_plans)
    while state.advance():
        pass
    stuck = [k for k, plan in enumerate(stage_plans) if state.done[k] < len(plan.actions)]
    if stuck:
        where = "; ".join(f"stage {k} at {stage_plans[k].actions[state.done[k]]} ({state.why[k]})" for k in stuck)
        raise ScheduleError(f"The schedule cannot run to its end: the stages would wait for each other: {where}.")
    for k, plan in enumerate(stage_plans):
        if training:
            _check_counts(k, plan)


class _Abstract:
    """The abstract execution of :func:`check`: each stage's position and the messages on each virtual link."""

    def __init__(self, stage_plans: Sequence[Plan]) -> None:
        self.plans, self.num_stages = stage_plans, len(stage_plans)
        self.model_chunks = 1 + max((a.model_chunk for plan in stage_plans for a in plan.actions), default=0)
        self.num_virtual = self.num_stages * self.model_chunks
        self.v_shape = any(plan.v_shape for plan in stage_plans)
        self.done = [0] * self.num_stages
        self.why = [""] * self.num_stages
        virtual = range(self.num_virtual)
        # micro-batch indices: an action's, None only where a plan gives none (check names what it finds)
        self.activations: list[list[int | None]] = [[] for _ in virtual]  # sent by virtual stage s to s+1, not received
        self.gradients: list[list[int | None]] = [[] for _ in virtual]  # sent by s to s-1, not yet received
        self.expected: list[list[int | None]] = [[] for _ in virtual]  # receives posted by s, in order
        self.posted: list[set[int | None]] = [set() for _ in virtual]  # every receive s posted
        self.losses: list[set[int]] = [set() for _ in virtual]
        self.forwarded: list[set[int | None]] = [set() for _ in virtual]

    def name(self, s: int) -> str:
        """Virtual stage ``s`` as the messages name it: ``stage k``, or ``stage k model chunk c`` with several."""
        k, c = stage_of_virtual(s, self.num_stages, self.v_shape)
        return f"stage {k}" + (f" model chunk {c}" if self.num_virtual > self.num_stages else "")

    def advance(self) -> bool:
        """Run every stage as far as it can; whether any stage moved."""
        moved = False
        for k, plan in enumerate(self.plans):
            while self.done[k] < len(plan.actions) and self._run(k, plan.actions[self.done[k]]):
                self.done[k] += 1
                moved = True
        return moved

    def _run(self, k: int, action: Action) -> bool:
        """Run ``action`` on stage ``k`` if what it needs is there (else note why not); whether it ran."""
        kind, i = action.kind, action.micro_batch
        s = virtual_stage(k, action.model_chunk, self.num_stages, self.v_shape)
        last = s == self.num_virtual - 1
        if kind is Kind.FORWARD:
            source = needs(kind, s, self.num_virtual)
            if source is not None:
                sender, queue = source[1], self.activations[source[1]]
                if not queue:
                    return self._wait(k, f"no activation from {self.name(sender)} yet")
                if queue[0] != i:
                    raise ScheduleError(
                        f"{self.name(s)} runs forward {i} but {self.name(sender)} sends micro-batch {queue[0]} first."
                    )
                queue.pop(0)
            self.forwarded[s].add(i)
        elif kind is Kind.SEND:
            if last or i not in self.forwarded[s]:
                raise ScheduleError(
                    f"{self.name(s)} sends micro-batch {i}, which it has not computed or has no receiver."
                )
            self.activations[s].append(i)
        elif kind is Kind.LOSS:
            if i is not None:
                self.losses[s].add(i)
        elif kind is Kind.EXPECT:
            if not last:
                self.expected[s].append(i)
                self.posted[s].add(i)
        elif kind is Kind.BACKWARD:
            return self._backward(k, s, i)
        elif kind is Kind.FLUSH:
            return self._flush(k)
        return True

    def _flush(self, k: int) -> bool:
        """Stage ``k``'s flush: every activation it sent received, every gradient it sent with its receive posted."""
        for t in (virtual_stage(k, c, self.num_stages, self.v_shape) for c in range(self.model_chunks)):
            if t < self.num_virtual - 1 and self.activations[t]:
                return self._wait(k, f"{self.name(t + 1)} has not received micro-batch {self.activations[t][0]} yet")
            unposted = [i for i in self.gradients[t] if i not in self.posted[t - 1]] if t > 0 else []
            if unposted:
                return self._wait(k, f"{self.name(t - 1)} has not posted the gradient of micro-batch {unposted[0]} yet")
        return True

    def _backward(self, k: int, s: int, i: int | None) -> bool:
        plan = self.plans[k]
        if i not in self.forwarded[s]:
            raise ScheduleError(f"{self.name(s)} runs backward {i} before forward {i}.")
        source = needs(Kind.BACKWARD, s, self.num_virtual)
        assert source is not None  # a backward always needs a gradient, or the loss of its own forward
        _, sender = source
        if sender == s:  # the last virtual stage: its own forward, then the loss
            if plan.loss_per_micro_batch and i not in self.losses[s]:
                raise ScheduleError(f"the last stage runs backward {i} before the loss of micro-batch {i}.")
        else:
            queue = self.gradients[sender]
            if not self.expected[s] or self.expected[s][0] != i:
                raise ScheduleError(f"{self.name(s)} runs backward {i} without its gradient's receive posted first.")
            if not queue:
                return self._wait(k, f"no gradient from {self.name(sender)} yet")
            if queue[0] != i:
                raise ScheduleError(
                    f"{self.name(s)} waits for the gradient of micro-batch {i} but {self.name(sender)} sends "
                    f"{queue[0]} first."
                )
            queue.pop(0)
            self.expected[s].pop(0)
        if s > 0:
            self.gradients[s].append(i)
        return True

    def _wait(self, k: int, why: str) -> bool:
        self.why[k] = why
        return False


def _check_counts(k: int, plan: Plan) -> None:
    """Every micro-batch's forward and backward once each per model chunk, its recompute and W (if any) between them."""
    position = {}
    for n, action in enumerate(plan.actions):
        key = (action.kind, action.micro_batch, action.model_chunk)
        if action.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.RECOMPUTE, Kind.WEIGHT) and key in position:
            raise ScheduleError(f"stage {k} runs {action} twice.")
        position[key] = n
    for model_chunk in sorted({a.model_chunk for a in plan.actions}):
        forwards = {a.micro_batch for a in plan.actions if a.kind is Kind.FORWARD and a.model_chunk == model_chunk}
        backwards = {a.micro_batch for a in plan.actions if a.kind is Kind.BACKWARD and a.model_chunk == model_chunk}
        if forwards != backwards or forwards != set(range(len(forwards))):
            # Action.micro_batch is int | None; a forward's and a backward's are ints (only a flush or loss has None)
            raise ScheduleError(
                f"stage {k} runs forwards {sorted(forwards)} but backwards {sorted(backwards)}."  # type: ignore[type-var]
            )
    for action in (a for a in plan.actions if a.kind in (Kind.RECOMPUTE, Kind.WEIGHT)):
        i, c = action.micro_batch, action.model_chunk
        if not position[(Kind.FORWARD, i, c)] < position[(action.kind, i, c)]:
            raise ScheduleError(f"stage {k} runs {action} before forward {i}.")
        before_backward = position[(action.kind, i, c)] < position[(Kind.BACKWARD, i, c)]
        if before_backward != (action.kind is Kind.RECOMPUTE):
            raise ScheduleError(f"stage {k} runs {action} on the wrong side of backward {i}.")


def format_plans(stage_plans: Sequence[Plan]) -> str:
    """The plans as a table, one row per stage: ``F`` forward, ``S`` send, ``L`` loss, ``E`` expect a gradient,
    ``R`` recompute, ``B`` backward, ``W`` weight gradient, ``|`` where the backward phase begins
    (:attr:`Plan.backward_from`)."""
    rows = []
    for k, plan in enumerate(stage_plans):
        cells = [str(a) for a in plan.actions]
        if plan.backward_from < len(cells):
            cells.insert(plan.backward_from, "|")
        rows.append(f"stage {k}: " + " ".join(cells))
    return "\n".join(rows)
