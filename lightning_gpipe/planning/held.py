"""What a stage holds for its transfers beyond what autograd saves: outputs and input gradients awaiting a flush.

The simulator counts a stage's kept inputs and saved activations (:mod:`lightning_gpipe.simulator`). The engine holds
more: a micro-batch's output stays alive while its record keeps it for the backward (its part that autograd does not
save: AmoebaNet's cell output is a concatenation no later operation saves) and while its send is unfinished, which
the stage only waits for at a ``flush`` action (:mod:`lightning_gpipe.transfer`): under fill-drain at the end of the
step, so a stage holds the outputs of all M micro-batches through its drain, and every input gradient it sends back
until then. :func:`held_peak` walks a stage's own plan (:func:`lightning_gpipe.schedule.plans`, the list the runtime
executes) and returns the peak of inputs, activations and these together, in bytes.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_gpipe.rematerialization import checkpointed
from lightning_gpipe.schedule import Action, Kind


@dataclass
class _Level:
    """The bytes a stage holds, as its plan runs (see :func:`held_peak`)."""

    input_bytes: int
    activation_bytes: int
    output_bytes: int
    output_saved_bytes: int
    level: int = 0
    peak: int = 0
    recorded: set = field(default_factory=set)  # micro-batches whose record holds an output
    sending: set = field(default_factory=set)  # micro-batches whose forward output an unfinished send holds
    from_forward: set = field(default_factory=set)  # ... whose record holds that same output (not recomputed)
    grads: int = 0  # bytes of input gradients sent and not yet flushed

    def add(self, nbytes: int) -> None:
        self.level += nbytes
        self.peak = max(self.peak, self.level)


def held_peak(
    actions: Sequence[Action], sends: bool, checkpoint: str, count: int, stage_bytes: tuple[int, int, int, int]
) -> int:
    """Peak bytes one stage holds over its plan: kept inputs, saved activations, outputs (held by their record until
    the backward or by their send until a flush) and sent input gradients (until a flush).

    Args:
        actions: the stage's plan (:attr:`lightning_gpipe.schedule.Plan.actions`).
        sends: whether the stage sends its outputs on (every stage but the last).
        checkpoint: the re-materialization mode.
        count: M, micro-batches.
        stage_bytes: per micro-batch, bytes of the stage's kept input (0 on the first stage: a view of the batch),
            its saved activations, its output, and of the output the activations include (saved by the last layer).
    """
    state = _Level(*stage_bytes)
    weights = {action.micro_batch for action in actions if action.kind is Kind.WEIGHT}
    for action in actions:
        _step(state, action, sends, checkpoint, count, weights)
    return state.peak


def _step(state: _Level, action: Action, sends: bool, checkpoint: str, count: int, weights: set) -> None:
    """Apply one action to ``state`` (``weights``: the micro-batches whose activations wait for a W action)."""
    kind, i = action.kind, action.micro_batch
    unsaved = state.output_bytes - state.output_saved_bytes
    if kind is Kind.FORWARD:
        if checkpointed(checkpoint, i, count):
            state.add(state.input_bytes + (state.output_bytes if sends else 0))
        else:
            state.add(state.input_bytes + state.activation_bytes + unsaved)
            state.recorded.add(i)
            state.from_forward.add(i)
        if sends:
            state.sending.add(i)
    elif kind is Kind.RECOMPUTE:
        state.add(state.activation_bytes + unsaved)
        state.recorded.add(i)
    elif kind is Kind.BACKWARD:
        state.recorded.discard(i)
        kept = i in state.sending and i in state.from_forward  # the send still holds the output, saved part too
        freed = state.input_bytes + unsaved * (not kept) - state.output_saved_bytes * kept
        state.add(-freed - (0 if i in weights else state.activation_bytes))
        state.from_forward.discard(i)
        state.grads += state.input_bytes
        state.add(state.input_bytes)
    elif kind is Kind.WEIGHT:
        state.add(-state.activation_bytes)
    elif kind is Kind.FLUSH:
        finished = len(state.sending - state.recorded)  # outputs a record still holds stay
        state.sending.clear()
        state.add(-state.output_bytes * finished - state.grads)
        state.grads = 0
