"""The plan's rules, once: what each action waits for, and a clock that runs the stages' actions by them.

A plan (:mod:`~lightning_gpipe.engine.actions`) is one stage's actions; the stages depend on each other through
their transfers alone. :func:`needs` is that rule: a forward of virtual stage ``s > 0`` takes virtual stage
``s - 1``'s forward of its micro-batch (the activation), a backward of ``s`` before the last takes ``s + 1``'s
backward of its micro-batch (the gradient), and the last virtual stage's backward takes its own forward (the loss
follows it on the same stage); every other action needs only its stage. Every reader of plans runs on it:

- :func:`~lightning_gpipe.engine.schedule.check` runs the plans abstractly, each needed output a message on the
  link it names;
- :class:`Clock` runs actions on a clock of their costs: a stage runs one action at a time, and an action starts
  once its stage is free and what it needs has arrived (its sender's end, plus the transfer's latency).
  ZB-V's order (:mod:`~lightning_gpipe.engine.schedule`), the placement of weight gradients
  (:mod:`~lightning_gpipe.engine.placement`) and the simulator (:mod:`lightning_gpipe.planning.simulator`) each run
  one.

Virtual stage ``s`` is model chunk ``c`` of pipeline rank ``k`` as :func:`~lightning_gpipe.engine.actions.
virtual_stage` places it (looped, or in a V).
"""

from collections.abc import Callable

from lightning_gpipe.engine.actions import Kind, stage_of_virtual, virtual_stage

Latency = Callable[[Kind, int], float]
"""``latency(kind, s)``: seconds a forward's activation (``Kind.FORWARD``) or a backward's gradient
(``Kind.BACKWARD``) travels to virtual stage ``s``, which needs it."""


def needs(kind: Kind, virtual: int, num_virtual: int) -> tuple[Kind, int] | None:
    """What an action of ``kind`` on virtual stage ``virtual`` (of ``num_virtual``) takes from another action:
    ``(kind, virtual stage)`` of the action, of the same micro-batch, whose output it needs (see the module
    docstring), or ``None`` for an action that needs only its stage."""
    if kind is Kind.FORWARD and virtual > 0:
        return Kind.FORWARD, virtual - 1
    if kind is Kind.BACKWARD:
        return (Kind.BACKWARD, virtual + 1) if virtual < num_virtual - 1 else (Kind.FORWARD, virtual)
    return None


def no_latency(kind: Kind, virtual: int) -> float:
    """A transfer that takes no time."""
    return 0.0


class Clock:
    """The stages' actions run on a clock of their costs (see the module docstring).

    Args:
        num_stages: K, the pipeline's processes.
        num_virtual: its virtual stages (``K * v``).
        v_shape: whether the model chunks are placed in a V (:func:`~lightning_gpipe.engine.actions.virtual_stage`).
        latency: how long each needed output travels (default: no time).

    Attributes:
        free: when each stage (pipeline rank) is next free, in seconds from 0.
        ended: ``(kind, virtual stage, micro-batch) -> seconds`` of every forward and backward run.
    """

    def __init__(self, num_stages: int, num_virtual: int, v_shape: bool = False, latency: Latency = no_latency) -> None:
        self.num_stages, self.num_virtual, self.v_shape, self.latency = num_stages, num_virtual, v_shape, latency
        self.free = [0.0] * num_stages
        self.ended: dict[tuple[Kind, int, int | None], float] = {}

    def virtual(self, stage: int, model_chunk: int) -> int:
        """The virtual stage of model chunk ``model_chunk`` of pipeline rank ``stage``."""
        return virtual_stage(stage, model_chunk, self.num_stages, self.v_shape)

    def stage_of(self, virtual: int) -> int:
        """The pipeline rank that runs virtual stage ``virtual``."""
        return stage_of_virtual(virtual, self.num_stages, self.v_shape)[0]

    def arrival(self, stage: int, kind: Kind, micro_batch: int | None, model_chunk: int) -> float | None:
        """When what the action needs is there: when its sender ended (plus the latency of a transfer), ``None``
        while the sender has not run; for an action that needs nothing, when its stage is free."""
        s = self.virtual(stage, model_chunk)
        source = needs(kind, s, self.num_virtual)
        if source is None:
            return self.free[stage]
        end = self.ended.get((source[0], source[1], micro_batch))
        if end is None or source[1] == s:
            return end
        return end + self.latency(kind, s)

    def run(
        self, stage: int, kind: Kind, micro_batch: int | None, model_chunk: int, seconds: float, at: float
    ) -> float:
        """Run an action of ``seconds`` on ``stage`` once it is free and ``at`` (its :meth:`arrival`) has passed;
        returns when it starts. A forward's or backward's end is kept in :attr:`ended`."""
        start = max(self.free[stage], at)
        self.free[stage] = start + seconds
        if kind in (Kind.FORWARD, Kind.BACKWARD):
            self.ended[(kind, self.virtual(stage, model_chunk), micro_batch)] = self.free[stage]
        return start
