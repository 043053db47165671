"""What a stage holds for its transfers beyond what autograd saves: outputs and input gradients whose send is pending,
and the buffers of output gradients whose receive is posted.

The simulator counts a stage's kept inputs and saved activations (:mod:`lightning_gpipe.planning.simulator`). The engine
holds
more: a micro-batch's output stays alive while its record keeps it for the backward (its part that autograd does not
save: AmoebaNet's cell output is a concatenation no later operation saves) and while its send is pending, and so does
an input gradient the stage sends back. A send completes once its receiver has posted the matching receive (gloo
moves a payload only then; an activation's is posted when the receiver runs that micro-batch's forward, a gradient's
ahead, by an ``expect`` action), and the stage drops its completed sends when it posts its next send and at a
``flush`` (:mod:`lightning_gpipe.engine.transfer`). :func:`held_peak` walks a stage's own plan
(:func:`lightning_gpipe.engine.schedule.plans`, the list the runtime executes) and returns the peak of inputs,
activations and these together, in bytes; :func:`held_levels` also what the stage holds where the user's loss runs.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_gpipe.engine import Action, Kind, checkpointed


@dataclass
class _Level:
    """The bytes a stage holds, as its plan runs (see :func:`held_peak`)."""

    input_bytes: int
    activation_bytes: int
    output_bytes: int
    output_saved_bytes: int
    level: int = 0
    peak: int = 0
    posted: set = field(default_factory=set)  # micro-batches whose output's send is pending
    from_forward: set = field(default_factory=set)  # ... whose record holds the forward's output (not recomputed)
    grads: int = 0  # bytes of input gradients whose send is pending
    expected: set = field(default_factory=set)  # micro-batches whose output gradient's receive is posted
    boundary: set = field(default_factory=set)  # last stage: re-materialized micro-batches whose fill output is held
    forwards: int = 0  # forwards left in the plan
    ahead: bool = False  # the next forward's input is received into a buffer posted at the one before
    at_loss: int = 0  # the most held at a ``loss`` action

    def add(self, nbytes: int) -> None:
        self.level += nbytes
        self.peak = max(self.peak, self.level)

    def release(self) -> None:
        """The pending sends complete: free the outputs only a send holds, and the input gradients."""
        alone = self.posted - self.from_forward  # a record holds the others, and frees them at their backward
        self.add(-self.output_bytes * len(alone) - self.grads)
        self.posted.clear()
        self.grads = 0


def held_peak(
    actions: Sequence[Action], sends: bool, checkpoint: str, micro_batches: int, stage_bytes: tuple[int, int, int, int]
) -> int:
    """The peak of :func:`held_levels`."""
    return held_levels(actions, sends, checkpoint, micro_batches, stage_bytes)[0]


def held_levels(
    actions: Sequence[Action], sends: bool, checkpoint: str, micro_batches: int, stage_bytes: tuple[int, int, int, int]
) -> tuple[int, int]:
    """Peak bytes one stage holds over its plan, and the most it holds at a ``loss`` action (where the last stage runs
    the user's step after the backbone; 0 without one): kept inputs, saved activations, outputs (held by their record
    until the backward, on the last stage a re-materialized one's too, which the loss took, beside the recomputed one;
    and by their send while it is pending), input gradients sent (while their send is pending) and the buffers inputs
    and output gradients are received into (an input's from the forward before its own, where the stage takes that
    input and posts the next one's receive; an output gradient's from its ``expect`` to its ``backward``, an output's
    size each).

    The rule for a send, which the stage's own plan alone must decide: it is pending from its action (``send``, or
    the ``backward`` whose input gradient it sends) until the stage's next send (a ``send`` action, or a
    ``backward`` on a stage whose kept input is not 0 bytes: every stage but the first sends input gradients) or
    ``flush``, and released there. That is the earliest the engine can free it: it looks for completed sends only
    when it posts one and at a flush. It assumes the receiver has posted the matching receive by then, so that the
    send has completed. For an activation sent before the stage's next ``backward``, the receiver did (it ran
    that forward before it sent the gradient the backward waits for); for one followed by another ``send``, only
    if the next stage keeps up (it runs that micro-batch's forward before this stage's next forward ends); for a
    gradient, if the previous stage's ``expect`` came first (it is posted ahead). A slower receiver makes the
    engine hold a send longer than this counts, until a later send or the flush.

    Args:
        actions: the stage's plan (:attr:`lightning_gpipe.engine.actions.Plan.actions`), or one model chunk's actions of
            it with the flushes: the sends of one link.
        sends: whether the stage sends its outputs on (every stage but the last).
        checkpoint: the re-materialization mode.
        micro_batches: M, micro-batches.
        stage_bytes: per micro-batch, bytes of the stage's kept input (0 on the first stage: a view of the batch),
            its saved activations, its output, and of the output the activations include (saved by the last layer).
    """
    state = _Level(*stage_bytes, forwards=sum(action.kind is Kind.FORWARD for action in actions))
    weights = {action.micro_batch for action in actions if action.kind is Kind.WEIGHT}
    for action in actions:
        _step(state, action, sends, checkpoint, micro_batches, weights)
    return state.peak, state.at_loss


def _step(state: _Level, action: Action, sends: bool, checkpoint: str, micro_batches: int, weights: set) -> None:
    """Apply one action to ``state`` (``weights``: the micro-batches whose activations wait for a W action)."""
    kind, i = action.kind, action.micro_batch
    unsaved = state.output_bytes - state.output_saved_bytes
    if kind is Kind.FORWARD:
        assert i is not None  # a forward is of one micro-batch
        own = 0 if state.ahead else state.input_bytes  # its input's buffer, if not posted at the forward before
        state.forwards -= 1
        state.ahead = state.forwards > 0  # taking this input posts the next one's receive
        received = own + state.input_bytes * state.ahead
        if checkpointed(checkpoint, i, micro_batches):  # the output: held by its send, or by its record for the loss
            state.add(received + state.output_bytes)
            if not sends:
                state.boundary.add(i)
        else:
            state.add(received + state.activation_bytes + unsaved)
            state.from_forward.add(i)
    elif kind is Kind.SEND:
        state.release()
        state.posted.add(i)
    elif kind is Kind.RECOMPUTE:
        state.add(state.activation_bytes + unsaved)
    elif kind is Kind.BACKWARD:
        kept = i in state.posted and i in state.from_forward  # the send still holds the output, saved part too
        freed = state.input_bytes + unsaved * (not kept) - state.output_saved_bytes * kept
        freed += state.output_bytes * (i in state.boundary)
        state.boundary.discard(i)
        state.add(-freed - (0 if i in weights else state.activation_bytes))
        state.from_forward.discard(i)
        state.add(state.input_bytes)  # the input gradient, made while the earlier sends are pending
        if i in state.expected:  # the output's gradient, received for it, is dropped
            state.expected.discard(i)
            state.add(-state.output_bytes)
        if state.input_bytes:  # its send: the earlier ones that completed are dropped, it is pending
            state.release()
            state.grads = state.input_bytes
    elif kind is Kind.EXPECT and sends:  # the buffer its output's gradient is received into
        state.expected.add(i)
        state.add(state.output_bytes)
    elif kind is Kind.WEIGHT:
        state.add(-state.activation_bytes)
    elif kind is Kind.FLUSH:
        state.release()
    elif kind is Kind.LOSS:
        state.at_loss = max(state.at_loss, state.level)
