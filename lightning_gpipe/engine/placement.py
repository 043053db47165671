"""Zero-bubble's weight gradients placed by cost (Qi et al. 2023, arXiv:2401.10241, section 3.2, its heuristic).

:func:`place_weights` takes each stage's plan without W (1F1B's order of forwards and input gradients B) and
places every deferred weight gradient W into it on a clock that runs the stages' plans together by the actions'
costs (:class:`~lightning_gpipe.engine.actions.ActionCost`) on the plans' clock (:class:`~lightning_gpipe.engine.clock.
Clock`: a forward or B starts once its process is free and its input has arrived, with no transfer time):

- a stage that would wait for an activation or a gradient at least a given share of its oldest outstanding W's
  time runs that W instead;
- before a forward that would make it hold more micro-batches (waiting for B or W) than any stage of the plans
  without W does (1F1B's first stage: K), it runs its oldest W to free one;
- before a last backward that is whole (the first virtual stage's, after which the data-parallel sync starts) it
  runs every outstanding W, else the remaining W follow its last B.

The placements of each share in :data:`GAP_SHARES`, and the given alternatives (ZB-H1's fixed one), are timed on
that clock, and the one whose step ends first wins (the first of them on a tie). W are local to a stage: every
stage's transfers are those of the plans without W, whatever the costs.
"""

from collections.abc import Sequence

from lightning_gpipe.engine.actions import COMPUTE, Action, ActionCost, Kind, Plan, splits_backward
from lightning_gpipe.engine.clock import Clock, needs

GAP_SHARES = (1.0, 0.5, 0.0)
"""The placements :func:`place_weights` tries: a W fills a wait of at least this share of its own time (and more
than none)."""


def place_weights(
    base: Sequence[Plan], costs: Sequence[ActionCost], alternatives: Sequence[Sequence[Plan]] = ()
) -> tuple[Plan, ...]:
    """The plans whose step ends first on the clock: ``base`` (every stage's plan without W, in 1F1B's order) with
    its W placed for each of :data:`GAP_SHARES`, or one of ``alternatives`` (every stage's plan with its W placed
    already), tried first.

    Args:
        base: one plan per stage (pipeline rank), its model chunks' backwards whole in the plan (no W actions).
        costs: one cost per virtual stage (model chunk c of stage k is virtual stage ``c * K + k``, or as
            :func:`~lightning_gpipe.engine.actions.virtual_stage` places it in a V where the plans say so).
        alternatives: complete plans to time beside the placements, preferred on a tie.
    """
    candidates = [_Placer(plans, costs) for plans in alternatives]
    candidates += [_Placer(base, costs, share) for share in GAP_SHARES]
    return min(candidates, key=lambda placer: placer.step_time).plans


class _Placer:
    """Runs the stages' plans (``base``) together on the plans' clock (:class:`~lightning_gpipe.engine.clock.Clock`)
    with the actions' costs, placing each stage's W with a
    ``share`` (see the module docstring); with ``share=None`` it only times ``base``, whose W are placed already."""

    def __init__(self, base: Sequence[Plan], costs: Sequence[ActionCost], share: float | None = None) -> None:
        self.base, self.costs, self.num_stages, self.share = base, costs, len(base), share
        self.v_shape = base[0].v_shape
        self.limit = max(_peak_held(plan) for plan in base)
        self.last_backward = [max(n for n, a in enumerate(plan.actions) if a.kind is Kind.BACKWARD) for plan in base]
        self.clock = Clock(self.num_stages, len(costs), self.v_shape)
        self.position = [0] * self.num_stages  # the next action of each base plan
        self.actions: list[list[Action]] = [[] for _ in base]
        # (micro-batch, model chunk) whose W waits
        self.outstanding: list[list[tuple[int | None, int]]] = [[] for _ in base]
        self.held = [0] * self.num_stages  # micro-batches forwarded whose B (or W) has not run
        self.plans = self._place()
        self.step_time = max(self.clock.free)

    def _place(self) -> tuple[Plan, ...]:
        """The placed plans: each stage advances in turn, the earliest free first, as far as its inputs are known."""
        ended = [False] * self.num_stages
        while not all(ended):
            for k in sorted(range(self.num_stages), key=lambda k: (ended[k], self.clock.free[k])):
                if not ended[k] and self._advance(k, ended):
                    break
            else:
                raise RuntimeError("The plans to place weight gradients into wait for each other.")
        v_shape = self.v_shape
        return tuple(
            Plan(tuple(a), backward_from=len(a), loss_per_micro_batch=True, v_shape=v_shape) for a in self.actions
        )

    def _advance(self, k: int, ended: list[bool]) -> bool:
        """Run stage ``k``'s next action, or a W instead; whether the stage moved (it does not while the input of
        its next forward or B is not placed yet and no W fits before it could arrive)."""
        base, start = self.base[k].actions, self.position[k]
        following = next((n for n in range(start, len(base)) if base[n].kind in COMPUTE), None)
        if following is None:  # every forward and B ran: the remaining W, then the closing flush
            self.actions[k] += [self._weight(k) for _ in list(self.outstanding[k])] + list(base[start:])
            ended[k] = True
            return True
        self.actions[k] += base[start:following]
        self.position[k] = following
        action = base[following]
        arrival = self.clock.arrival(k, action.kind, action.micro_batch, action.model_chunk)
        if self.outstanding[k] and self._weight_first(k, action, arrival):
            self.actions[k].append(self._weight(k))
            return True
        if arrival is None:
            return False
        self._run(k, action, arrival)
        self.position[k] += 1
        return True

    def _weight_first(self, k: int, action: Action, arrival: float | None) -> bool:
        """Whether stage ``k`` runs its oldest W before ``action``: memory is at the limit before a forward, the
        action is a whole last backward, or the stage would wait for the action's input at least ``share`` of the
        W's time (``arrival``: when the input arrives; ``None``: not placed yet, so not before its sender is free
        and has computed it)."""
        if action.kind is Kind.FORWARD and self.held[k] >= self.limit:
            return True
        if self.position[k] == self.last_backward[k] and not splits_backward(
            self._virtual(k, action.model_chunk), True
        ):
            return True  # the data-parallel sync starts after the plan's last backward
        _, model_chunk = self.outstanding[k][0]
        assert self.share is not None  # W are outstanding only where this clock places them
        wait = (self._earliest(k, action) if arrival is None else arrival) - self.clock.free[k]
        return wait > 0 and wait >= self.share * self.costs[self._virtual(k, model_chunk)].weight

    def _earliest(self, k: int, action: Action) -> float:
        """A lower bound of when ``action``'s input, not placed yet, arrives: its sender free, then computing it."""
        source = needs(action.kind, self._virtual(k, action.model_chunk), len(self.costs))
        assert source is not None  # an action that needs nothing arrives when its stage is free, never unplaced
        kind, sender = source
        cost = self.costs[sender]
        seconds = cost.forward if kind is Kind.FORWARD else cost.backward
        return self.clock.free[self.clock.stage_of(sender)] + seconds

    def _run(self, k: int, action: Action, arrival: float) -> None:
        """Place ``action`` on stage ``k`` once it is free and its input has arrived."""
        s = self._virtual(k, action.model_chunk)
        self.clock.run(k, action.kind, action.micro_batch, action.model_chunk, self._seconds(action, s), arrival)
        if action.kind is Kind.FORWARD:
            self.held[k] += 1
        elif action.kind is Kind.WEIGHT or (action.kind is Kind.BACKWARD and not splits_backward(s, True)):
            self.held[k] -= 1
        elif action.kind is Kind.BACKWARD and self.share is not None:
            self.outstanding[k].append((action.micro_batch, action.model_chunk))
        self.actions[k].append(action)

    def _seconds(self, action: Action, s: int) -> float:
        """The time of ``action`` on virtual stage ``s`` (a B of the first virtual stage is whole: B and W)."""
        cost = self.costs[s]
        if action.kind is Kind.BACKWARD:
            return cost.backward + (0.0 if splits_backward(s, True) else cost.weight)
        return {Kind.FORWARD: cost.forward, Kind.RECOMPUTE: cost.forward, Kind.LOSS: cost.loss}.get(
            action.kind, cost.weight
        )

    def _weight(self, k: int) -> Action:
        """Stage ``k``'s oldest outstanding W, placed now."""
        i, model_chunk = self.outstanding[k].pop(0)
        self.clock.run(
            k, Kind.WEIGHT, i, model_chunk, self.costs[self._virtual(k, model_chunk)].weight, self.clock.free[k]
        )
        self.held[k] -= 1
        return Action(Kind.WEIGHT, i, model_chunk)

    def _virtual(self, k: int, model_chunk: int) -> int:
        return self.clock.virtual(k, model_chunk)


def _peak_held(plan: Plan) -> int:
    """The most micro-batches (of any model chunk) ``plan`` holds between their forward and their backward."""
    held = peak = 0
    for action in plan.actions:
        held += (action.kind is Kind.FORWARD) - (action.kind is Kind.BACKWARD)
        peak = max(peak, held)
    return peak
