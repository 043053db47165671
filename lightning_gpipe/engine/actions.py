"""The vocabulary of pipeline schedules: what a stage's plan is made of (:mod:`lightning_gpipe.engine.schedule`).

A :class:`Plan` is one stage's ordered :class:`Action` list for one training step. The kinds (:class:`Kind`):
``forward`` (take micro-batch i's input, scattered on the first stage or received from the previous one, and run
the stage's layers), ``send`` (its output to the next stage, asynchronously), ``loss`` (on the last stage, the
user's head and loss on micro-batch i, backpropagated to the boundary; ``None``: on the whole mini-batch, in the
user's ``training_step`` after the backbone call), ``expect`` (post the receive of micro-batch i's output gradient;
receives match in posting order), ``recompute`` (re-materialize a checkpointed micro-batch's forward), ``backward``
(its input gradient, sent to the previous stage at once; with deferred weight gradients only that, B), ``weight``
(its deferred weight gradient, W) and ``flush`` (wait until this stage's sends have completed). An
:class:`ActionCost` is what a schedule placed by cost knows of a virtual stage's actions.
"""

import enum
from dataclasses import dataclass
from functools import cached_property


class Kind(str, enum.Enum):
    """What an :class:`Action` does (see the module docstring); the value is the name spans and the simulator use."""

    FORWARD = "forward"
    SEND = "send"
    LOSS = "loss"
    EXPECT = "expect"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    WEIGHT = "weight"
    FLUSH = "flush"


COMPUTE = (Kind.FORWARD, Kind.LOSS, Kind.RECOMPUTE, Kind.BACKWARD, Kind.WEIGHT)
"""The kinds that take compute time (the simulator times these; the others move or wait for data)."""

_SHORT = {Kind.FORWARD: "F", Kind.SEND: "S", Kind.LOSS: "L", Kind.EXPECT: "E", Kind.RECOMPUTE: "R"}
_SHORT.update({Kind.BACKWARD: "B", Kind.WEIGHT: "W", Kind.FLUSH: "flush"})


@dataclass(frozen=True)
class Action:
    """One step of a stage's plan.

    Args:
        kind: what the action does.
        micro_batch: the micro-batch index, 0-based; ``None`` for a flush and for a loss on the whole mini-batch.
        model_chunk: the stage's model chunk (virtual stage) the action runs on; 0 for schedules with one model chunk
            per stage.
    """

    kind: Kind
    micro_batch: int | None = None
    model_chunk: int = 0

    def __str__(self) -> str:
        index = "" if self.micro_batch is None else str(self.micro_batch)
        return f"{_SHORT[self.kind]}{index}" + (f".{self.model_chunk}" if self.model_chunk else "")


@dataclass(frozen=True)
class Plan:
    """One stage's actions for one training step.

    Args:
        actions: in the order the stage runs them.
        backward_from: where the step's backward phase begins: ``actions[:backward_from]`` run in the pipeline's
            ``forward`` call, ``actions[backward_from:]`` in its ``backward`` call (``len(actions)`` where the whole
            plan runs in ``forward``, with a loss per micro-batch).
        loss_per_micro_batch: whether the last stage runs the user's step once per micro-batch (``loss`` actions
            with an index), rather than once on the whole mini-batch between the two parts.
        v_shape: whether the stages' model chunks are placed in a V (:func:`virtual_stage`), not looped.
    """

    actions: tuple[Action, ...]
    backward_from: int
    loss_per_micro_batch: bool = False
    v_shape: bool = False

    def count(self, kind: Kind) -> int:
        """How many actions of ``kind`` the plan holds."""
        return sum(action.kind is kind for action in self.actions)

    @cached_property
    def forwards_first(self) -> bool:
        """Whether the plan runs backwards and every forward before the first of them (fill-drain's fill): the stage
        then holds every micro-batch's input at once, so receiving them all ahead raises no peak."""
        kinds = [action.kind for action in self.actions if action.kind in (Kind.FORWARD, Kind.BACKWARD)]
        return Kind.BACKWARD in kinds and kinds.index(Kind.BACKWARD) == kinds.count(Kind.FORWARD)

    @cached_property
    def backward_follows_loss(self) -> bool:
        """Whether the plan has ``loss`` actions per micro-batch, in micro-batch order, each followed by the same
        micro-batch's ``backward`` before any other computing action of its model chunk (a recompute of that
        micro-batch aside): then a loss's backward can run on through the model chunk in the same autograd call, and
        the model chunk's autograd calls keep the plan's order (1F1B's last stage)."""
        pending, expected = None, 0
        for action in self.actions:
            kind, index = action.kind, action.micro_batch
            if kind not in COMPUTE or (pending is not None and kind is Kind.RECOMPUTE and index == pending[0]):
                continue
            if pending is not None:
                if (kind, index, action.model_chunk) != (Kind.BACKWARD, *pending):
                    return False
                pending = None
            elif kind is Kind.LOSS:
                if index != expected:
                    return False
                pending, expected = (index, action.model_chunk), expected + 1
        return pending is None and expected > 0


@dataclass(frozen=True)
class ActionCost:
    """Seconds of one micro-batch's actions on one virtual stage, for a schedule that places actions by their cost
    (``"zb-1p"``). The defaults are zero-bubble's assumption of equal forward, input gradient and weight gradient
    times (Qi et al. 2023, section 2): what a plan is placed by when nothing was measured.

    Args:
        forward: F, the forward (and a recompute).
        backward: B, the backward's input gradient (on the first virtual stage, which does not split its backwards,
            the whole backward is ``backward + weight``).
        weight: W, the backward's weight gradient.
        loss: on the last virtual stage, the user's head and loss and their backward to the boundary (default 0).
    """

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0
    loss: float = 0.0


def virtual_stage(stage: int, model_chunk: int, num_stages: int, v_shape: bool = False) -> int:
    """The virtual stage that model chunk ``model_chunk`` of pipeline rank ``stage`` runs, of ``K = num_stages`` ranks.

    Looped (default): ``model_chunk * K + stage``, so rank k holds virtual stages k, k + K, ... (interleaved pipelines,
    Narayanan et al. 2021, section 2.2). With ``v_shape`` the odd model chunks run through the ranks backwards: rank k
    holds virtual stages k and 2K - 1 - k, the micro-batches turn on rank K - 1 and the pipeline's last virtual
    stage is on rank 0 with its first (ZB-V, Qi et al. 2023, arXiv:2401.10241, section 6).
    """
    offset = num_stages - 1 - stage if v_shape and model_chunk % 2 else stage
    return model_chunk * num_stages + offset


def stage_of_virtual(virtual: int, num_stages: int, v_shape: bool = False) -> tuple[int, int]:
    """``(pipeline rank, model chunk)`` of virtual stage ``virtual``: the inverse of :func:`virtual_stage`."""
    model_chunk, offset = divmod(virtual, num_stages)
    return (num_stages - 1 - offset if v_shape and model_chunk % 2 else offset), model_chunk


def splits_backward(virtual_index: int, defer: bool) -> bool:
    """Whether a (virtual) stage splits its backwards into B and W when weight gradients are deferred (``defer``):
    the first sends no input gradient, so it does not."""
    return defer and virtual_index > 0
