"""One model chunk's primitives: take the micro-batches, forward one, send it, receive a gradient, backward one.

A model chunk is a stage's piece of the backbone, one virtual stage of the pipeline (a stage holds one, or
``virtual_stages`` of them). A schedule (:mod:`lightning_gpipe.engine.schedule`) decides the order of these calls,
which the runtime (:class:`lightning_gpipe.engine.pipeline.Runtime`) makes; the model chunk does each
one and keeps what a micro-batch's backward needs: its input, its output (or, when re-materialized,
the random state to recompute it from), and the shapes of the gradients that will come back.
Parameter gradients accumulate over the micro-batches, so a mini-batch's micro-batches together
give the gradients of mini-batch training (GPipe, Huang et al. 2019, section 2.2).

On the last stage, a training forward returns the micro-batch's output as detached leaves that
require grad (the boundary): the user's loss runs on their concatenation, and its backward leaves
each micro-batch's output gradient in the leaves' ``.grad``, where the micro-batch's backward takes it.
Where the user's loss runs per micro-batch and the plan backpropagates each micro-batch right after its loss
(1F1B's last stage, :attr:`~lightning_gpipe.engine.actions.Plan.backward_follows_loss`), a micro-batch that is not
re-materialized keeps its output's graph instead: the loss's backward runs on through the stage in one autograd
call, as on one device, and the micro-batch's backward only sends the input gradients.

Re-materialization (section 2.2, :mod:`lightning_gpipe.engine.rematerialization`): a checkpointed
micro-batch runs forward without autograd, keeping only its input; :meth:`ModelChunk.recompute` runs it
again with autograd before its backward. Timing spans (:mod:`lightning_gpipe.engine.events`) of forwards,
recomputes and backwards are taken here; those of transfers in :class:`~lightning_gpipe.engine.transfer.Link`.

Deferred weight gradients (zero-bubble pipelines, Qi et al. 2023; :mod:`lightning_gpipe.engine.weightgrad`): with
``defer_weight_grad``, :meth:`ModelChunk.backward` computes and sends the input gradient (B) and queues the weight
gradient (W), which :meth:`ModelChunk.backward_weights` runs later, where the schedule places it.

Activation offload (:mod:`lightning_gpipe.engine.offload`): with ``offload``, a forward the runtime's plan offloads runs
under its hooks, and what it saved goes to host memory but for what the model chunk keeps anyway (its input, output
and skip tensors); the runtime brings it back where the plan places the prefetch.

Skip connections (:mod:`lightning_gpipe.engine.skip`): each micro-batch's forward runs under its own skip tracker,
given the tensors earlier stages stashed for it (received before it runs); what is still stashed after the
stage's layers ran goes straight to the stages that pop it (:class:`~lightning_gpipe.engine.skip.links.SkipLinks`).
Those tensors are outputs of the micro-batch like its activation (their gradients come back and are
backpropagated with the activation's), and the received ones inputs (their gradients are sent back).
"""

import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import cast

import torch
from torch import Tensor

from lightning_gpipe.engine import microbatch
from lightning_gpipe.engine.events import gradient_times
from lightning_gpipe.engine.microbatch import MicroBatch, Partition, Value
from lightning_gpipe.engine.offload import ActivationOffload
from lightning_gpipe.engine.rematerialization import RngState, checkpointed
from lightning_gpipe.engine.skip import tracker
from lightning_gpipe.engine.skip.links import SkipLinks
from lightning_gpipe.engine.transfer import Link, Meta, Signature, signature
from lightning_gpipe.engine.weightgrad import DeferredWeightGradient, backward_input, run_together


@dataclass
class _Record:
    """What the backward of one micro-batch needs."""

    input: Value
    output: Value | None  # None while checkpointed: recomputed before the backward
    metas: list[Meta]  # shapes and dtypes of the floating-point outputs, whose gradients come back
    micro: MicroBatch
    rng: RngState | None = None
    boundary: list[Tensor] = field(default_factory=list)  # last stage: the leaves handed to the user's loss
    through: bool = False  # last stage: the output kept its graph, and the loss's backward runs through the stage
    skip_in: dict = field(default_factory=dict)  # skip tensors received from earlier stages (leaves), by key
    skip_out: dict = field(default_factory=dict)  # skip tensors stashed for later stages, by key


class ModelChunk:
    """Executes the work of one model chunk (a virtual stage of the pipeline; with one model chunk per process, the
    stage), one micro-batch at a time, in the order a schedule calls it.

    Args:
        partition: the model chunk's layers.
        link: transfers to the neighbouring virtual stages; its ``events`` recorder is the model chunk's.
        virtual_stage: the virtual stage this model chunk runs (0-based; the pipeline rank with one model chunk per
            stage).
        num_virtual: the pipeline's virtual stages (K with one model chunk per stage).
        micro_batches: M, micro-batches per mini-batch (fewer when the batch has fewer rows).
        checkpoint: ``"always"``, ``"except_last"`` (all micro-batches but the last) or ``"never"``.
        defer_weight_grad: ``True`` splits each backward of a stage that sends input gradients into B (sent at
            once) and W (queued for :meth:`backward_weights`); ``False`` (default) runs them together.
        skips: the model chunk's skip connections (:class:`~lightning_gpipe.engine.skip.links.SkipLinks`, its links
            to other stages, maybe none); ``None`` (default): its layers neither stash nor pop a skip.
        offload: moves what the forwards it plans save for their backward to host memory (``None``, default: none).

    Attributes:
        events: the :class:`~lightning_gpipe.engine.events.Recorder` the pipeline callbacks read.
        pops: whether the model chunk pops skip tensors from earlier stages (they arrive with each micro-batch).
        training: whether the current forward keeps what a backward needs (gradients were enabled when
            :meth:`inputs` started).
        before_last_backward: called with the outputs of the step's last backward right before its autograd call,
            the one that completes this stage's parameter gradients (W when deferred); set through
            :meth:`~lightning_gpipe.engine.StagePipeline.on_last_backward`.
        loss_through: on the last stage, whether a loss may backpropagate through the stage in its own autograd call
            (:attr:`~lightning_gpipe.engine.actions.Plan.backward_follows_loss`; set by the runtime, default ``False``).
        receive_ahead: whether the model chunk posts all its step's activation receives at once, not one ahead
            (:attr:`~lightning_gpipe.engine.actions.Plan.forwards_first`; set by the runtime, default ``False``).
    """

    def __init__(
        self,
        partition: Partition,
        link: Link,
        virtual_stage: int,
        num_virtual: int,
        micro_batches: int,
        checkpoint: str,
        defer_weight_grad: bool = False,
        skips: SkipLinks | None = None,
        offload: ActivationOffload | None = None,
    ) -> None:
        self.partition, self.link, self.offload = partition, link, offload
        self.skips = skips
        self.pops = skips is not None and skips.pops
        self.virtual_stage = virtual_stage
        self.is_first, self.is_last = virtual_stage == 0, virtual_stage == num_virtual - 1
        self.micro_batches, self.checkpoint, self.defer_weight_grad = micro_batches, checkpoint, defer_weight_grad
        self.events = link.events
        self.training = False
        self.before_last_backward: Callable[[list[Tensor]], None] | None = None
        self.loss_through = False
        self.receive_ahead = False
        self.shapes = Shapes()
        self.name = f"virtual stage {virtual_stage}"
        self._records: dict[int, _Record] = {}
        self._weights: deque[tuple[int, DeferredWeightGradient, list[Tensor]]] = deque()
        self._backwards = 0  # of the current step
        self._filled = 0.0  # when the last stage's forward ended: its "loss" span runs from there to the backward

    def inputs(self, value: Value | None) -> Iterator[tuple[int, Value, int]]:
        """The model chunk's inputs of one mini-batch as ``(index, input, micro_batches)``, micro_batches being M.

        The first virtual stage scatters ``value`` (the backbone input); the others receive their inputs from the
        previous one and ignore ``value``, M and their shapes from its step message first. Either way the model
        chunk then sends the next virtual stage its own step message: M and the shapes of its outputs, predicted
        from the inputs' (:class:`Shapes`). Starting it starts a new forward: what the last one kept is dropped.

        Raises:
            TypeError, ValueError: for a backbone input that cannot be split (see
                :func:`lightning_gpipe.engine.microbatch.scatter`).
            PipelineFailure: if the previous stage failed while this one waited for it.
        """
        self.training, self._records, self._backwards = torch.is_grad_enabled(), {}, 0
        if self.is_first:
            parts = microbatch.scatter(cast(Value, value), self.micro_batches)  # the first stage is given it
            self._begin_step(len(parts), [_scattered_key(part) for part in parts])
            yield from ((i, x, len(parts)) for i, x in enumerate(parts))
            return
        count, arriving = self.link.receive_step()
        self._begin_step(count, arriving)
        for index in range(count):
            x = self.link.recv_activation(self.receive_ahead)
            yield index, (microbatch.leaves(x) if self.training else x), count

    def _begin_step(self, micro_batches: int, keys: Sequence[Hashable | None]) -> None:
        """Predict this step's output shapes from the inputs' (``keys``; ``None``: not known before they arrive) and
        send the next virtual stage its step message. A model chunk that pops skip tensors predicts nothing: they
        arrive with the micro-batch."""
        keys = [None] * len(keys) if self.pops else keys
        self.link.send_step(micro_batches, self.shapes.begin_step(keys, self.training))

    def forward(self, index: int, x: Value, micro_batches: int) -> Value:
        """Run micro-batch ``index`` of ``micro_batches`` through this stage's layers and return its output.

        In training, keeps what its backward needs; a checkpointed micro-batch runs without autograd. Skip tensors
        popped here are received from their stashing stages first; those stashed here for later stages are sent
        to them at once.
        On the last stage in training, the output is returned as boundary leaves (see the module docstring),
        except on a pipeline of one stage running one micro-batch without re-materialization: there is nothing
        to schedule, so the output keeps its graph and the user's backward runs through the layers directly.

        Raises:
            TypeError: if a layer returns anything but a Tensor or a tuple of Tensors.
            PipelineFailure: if a stage this one pops a skip from failed while this one waited for it.
        """
        training, skips = self.training, self.skips
        received = skips.receive(training) if skips is not None else {}
        remat = training and self.checkpoint != "never" and checkpointed(self.checkpoint, index, micro_batches)
        rng = RngState.capture(self.link.device) if remat else None
        micro = MicroBatch(index, micro_batches)
        with (
            torch.set_grad_enabled(training and not remat),
            microbatch.running(micro),
            _tracking(skips, received) as stashed,
            self.events.span("forward", index, (self.partition, x) if training else None),
            _saving(self.offload, index, training and not remat) as handles,
        ):
            y = self.partition.run(x, kept=training)
        _keep(self.offload, index, handles, (x, y), (received, stashed))
        if not self.is_last:  # a headed input (not scattered, no skips): its shapes are known now
            self.shapes.check(index, x, y, not (self.is_first or self.pops), f"micro-batch {index} of {self.name}")
        if skips is not None:
            skips.send(stashed, index)
        if not training or (self.is_first and self.is_last and micro_batches == 1 and not remat):
            return y
        metas = [(t.shape, t.dtype) for t in microbatch.floats(y)]
        record = self._records[index] = _Record(x, None if remat else y, metas, micro, rng)
        record.skip_in, record.skip_out = received, stashed
        if self.is_last:  # the output keeps its graph where it may (see `loss_through`), else it is the boundary
            record.through = self.loss_through and not remat and not self.defer_weight_grad and _in_graph(y)
            if not record.through:
                y = microbatch.leaves(y)
                record.boundary = microbatch.floats(y)
        return y

    def loss(self, index: int, y: Value, head: Callable[[Value], None]) -> None:
        """On the last stage, run ``head`` on micro-batch ``index``'s output ``y``: the user's step on the
        micro-batch, which backpropagates its loss to ``y``, and through this stage when ``y`` kept its graph.

        Recorded as a ``loss`` span; the part of a loss's backward that runs through the stage, from when it
        reaches ``y``, as the micro-batch's ``backward`` span.
        """
        record = self._records.get(index)
        timed = record is not None and record.through and self.events.enabled
        no_hook: AbstractContextManager[list[float]] = nullcontext([])
        reaching = gradient_times(microbatch.floats(y)[0]) if timed else no_hook
        with reaching as reached, self.events.span("loss", index):
            head(y)
        if timed:
            self.events.split_last("backward", reached[0] if reached else None)

    @property
    def loss_completes_gradients(self) -> bool:
        """On the last stage, during a micro-batch's loss (see :meth:`loss`): whether its backward is the step's last
        autograd call through this stage, which completes its parameter gradients: the micro-batch kept its graph
        and every other micro-batch's backward has run."""
        records = list(self._records.values())
        return len(records) == 1 and records[0].through and self._backwards == records[0].micro.micro_batches - 1

    def send(self, y: Value, index: int) -> None:
        """Send micro-batch ``index``'s output to the next virtual stage, asynchronously."""
        self.link.send_activation(y, index)

    def output(self, parts: list[Value]) -> Value:
        """The last stage's backbone output of the whole mini-batch, from its micro-batch outputs in order."""
        self._filled = time.perf_counter()
        return microbatch.gather(parts)

    def flush(self) -> None:
        """Wait until every send of this stage has completed; in training, skip tensors sent to a later stage
        are waited for by the backward of their micro-batch instead (:meth:`SkipLinks.backward
        <lightning_gpipe.engine.skip.links.SkipLinks.backward>`), since under 1F1B their receiver may be micro-batches
        behind.

        Raises:
            PipelineFailure: if a neighbour failed while this one waited for it.
        """
        self.link.flush()
        if self.skips is not None:
            self.skips.flush(sent=not self.training)

    def begin_backward(self) -> int:
        """Start the backward of the last forward; returns its number of micro-batches, M.

        On the last stage, the user's loss must have been backpropagated to the boundary first.
        """
        if self._records and self.is_last and self.events.enabled:
            self.events.add("loss", None, self._filled, time.perf_counter())
        return len(self._records)

    @property
    def draining(self) -> bool:
        """Whether micro-batches of the last training forward wait for their backward on this stage (not so on a
        one-stage pipeline that ran one micro-batch without re-materialization: the user's backward covers it)."""
        return bool(self._records)

    def expect_grad(self, index: int) -> None:
        """Post the receive of micro-batch ``index``'s output gradients (nothing on the last stage), and of its
        stashed skip tensors' from the stages that pop them.

        Receives are matched in posting order: post them in the order the next stage sends them.
        """
        record = self._records[index]
        if not self.is_last:
            self.link.post_grads(record.metas, index)
        if self.skips is not None:
            self.skips.expect_grads(record.skip_out)

    def recompute(self, index: int) -> None:
        """Re-materialize micro-batch ``index``'s forward with autograd, if it was checkpointed.

        Replays the random state of its first forward, so dropout draws the same masks, and runs under
        :func:`~lightning_gpipe.engine.microbatch.current_micro_batch` with ``recompute=True``.
        """
        record = self._records[index]
        if record.output is not None:
            return
        micro = replace(record.micro, recompute=True)
        with (
            self.events.span("recompute", index, (self.partition, record.input)),
            cast(RngState, record.rng).restored(),  # a checkpointed micro-batch kept it
            torch.enable_grad(),
            microbatch.running(micro),
            _tracking(self.skips, record.skip_in) as stashed,
        ):
            record.output = self.partition.run(record.input, kept=True)
        record.skip_out = stashed

    def backward(self, index: int) -> None:
        """Backpropagate micro-batch ``index`` (recomputed first, if checkpointed) and send its input gradients.

        The output gradients come from the boundary on the last stage, else from the next stage (posted with
        :meth:`expect_grad`). With ``defer_weight_grad`` on a stage after the first, only the input gradient
        is computed here and the weight gradient is queued (see :meth:`backward_weights`); the first stage
        sends nothing back, so it has nothing to gain from the split.

        Raises:
            PipelineFailure: if the next stage failed while this one waited for it.
        """
        self.recompute(index)
        record = self._records.pop(index)
        self._backwards += 1
        if not record.through:  # else the loss's backward ran through the stage (see `loss`)
            self._backpropagate(index, record, last=self._backwards == record.micro.micro_batches)
        if not self.is_first:
            inputs = microbatch.floats(record.input)  # as received: their gradients go back in their layouts
            self.link.send_grads([x.grad if x.grad is not None else torch.zeros_like(x) for x in inputs], index, inputs)
        if self.skips is not None:
            self.skips.send_grads(record.skip_in, index)

    def _backpropagate(self, index: int, record: _Record, last: bool) -> None:
        """The autograd call of micro-batch ``index``'s backward (B only, with W queued, when deferred), from its
        output gradients; ``last``: whether it is the step's last backward on this stage."""
        outputs, skips = microbatch.floats(cast(Value, record.output)), self.skips  # the output: kept or recomputed
        grads = [b.grad for b in record.boundary] if self.is_last else self.link.recv_grads(index)
        if skips is not None:  # the stashed tensors sent on are outputs too
            outputs, grads = outputs + skips.outputs(record.skip_out), grads + skips.backward(index)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        skip_inputs = microbatch.floats(tuple(record.skip_in.values()))
        needed = [x for x in microbatch.floats(record.input) + skip_inputs if x.requires_grad]
        if pairs:
            with self.events.span("backward", index):
                if self.defer_weight_grad and needed:
                    sent, received = zip(*pairs)
                    self._weights.append((index, backward_input(sent, received, needed), outputs if last else []))
                else:
                    if last:
                        self._announce_last_backward(outputs)
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def backward_weights(self, indices: Sequence[int]) -> None:
        """W: add the weight gradients of micro-batches ``indices`` (in the order of their B), queued by their
        :meth:`backward`, to the parameters' ``.grad``; several at once run each plain linear layer's as one matrix
        product over their rows (:func:`~lightning_gpipe.engine.weightgrad.run_together`). Nothing for a micro-batch
        whose W was not deferred (W runs in the order of the B's).

        The time of several W run at once is recorded as one ``weight`` span per micro-batch, each an equal share.
        """
        weights, announce = [], []
        for index in indices:
            if self._weights and self._weights[0][0] == index:
                _, weight, last_outputs = self._weights.popleft()
                weights.append((index, weight))
                announce += last_outputs
        if not weights:
            return
        start = time.perf_counter()
        run_together(
            [weight for _, weight in weights], (lambda: self._announce_last_backward(announce)) if announce else None
        )
        share = (time.perf_counter() - start) / len(weights)
        for n, (index, _) in enumerate(weights):
            self.events.add("weight", index, start + n * share, start + (n + 1) * share)

    def _announce_last_backward(self, outputs: list[Tensor]) -> None:
        if self.before_last_backward is not None:
            self.before_last_backward(outputs)


def _saving(offload: ActivationOffload | None, index: int, saves: bool) -> AbstractContextManager:
    """Where a forward that ``saves`` for its backward runs micro-batch ``index``: under ``offload``'s hooks if it
    plans the micro-batch (yielding their handles), else as it is (yielding none)."""
    return offload.saving() if offload is not None and saves and index in offload.planned else nullcontext({})


def _keep(offload: ActivationOffload | None, index: int, handles: dict, values: tuple, skips: tuple[dict, ...]) -> None:
    """Move micro-batch ``index``'s saved tensors (``handles``) to host memory, but for those sharing storage with
    what the model chunk keeps anyway: its input and output (``values``) and its skip tensors (``skips``)."""
    if offload is not None and handles:
        kept = [t for value in values for t in microbatch.tensors(value)] + [t for d in skips for t in d.values()]
        offload.keep(index, handles, kept)


@contextmanager
def _tracking(skips: SkipLinks | None, received: dict) -> Iterator[dict]:
    """Run the block under a skip tracker given the ``received`` skip tensors, where the model chunk has skip
    connections (``skips``); yields the dict of those stashed in the block and not popped, which fills as it runs."""
    if skips is None:
        yield {}
        return
    with tracker.tracking(tracker.SkipTracker(received)) as tracked:
        yield tracked.stashed


class Shapes:
    """What a model chunk's forward makes of its inputs' shapes: each output signature learnt by the input's, so
    that a step's output shapes are known before they are computed, for the step message (see
    :mod:`~lightning_gpipe.engine.transfer`).

    A backbone layer's output shapes must follow from its input's, not from its values (as under torch's own
    pipelining, which fixes them once): an output whose shapes differ from those an earlier step made of the same
    input shapes is refused, since the next stage has already posted its receive.
    """

    LIMIT = 1024
    """The most input signatures kept (the oldest go first)."""

    def __init__(self) -> None:
        self._known: dict[Hashable, Signature] = {}
        self._keys: list[Hashable | None] = []  # of the step's inputs
        self._predicted: list[Signature | None] = []  # the step's output signatures, as announced
        self._training = False

    def begin_step(self, keys: Sequence[Hashable | None], training: bool) -> list[Signature | None]:
        """The step's output signatures predicted from its inputs' ``keys`` (``None``: not known before the input
        arrives), in training or not; kept for :meth:`check`."""
        self._keys = [None if key is None else (training, key) for key in keys]
        self._predicted, self._training = [self.predict(key) for key in self._keys], training
        return self._predicted

    def check(self, index: int, x: Value, y: Value, headed: bool, where: str) -> None:
        """Learn micro-batch ``index``'s output shapes (of ``y``) from its input ``x``'s, and check the step's
        prediction of them; ``headed``: whether an input whose key was not known ahead is known now (it arrived
        headed by its signature).

        Raises:
            RuntimeError: as :meth:`learn`, naming ``where``.
        """
        key = self._keys[index]
        if key is None and headed:
            key = (self._training, signature(x))
        self.learn(key, signature(y), self._predicted[index], where)

    def predict(self, key: Hashable | None) -> Signature | None:
        """The output signature learnt for the input ``key``; ``None`` if there is none yet."""
        return None if key is None else self._known.get(key)

    def learn(self, key: Hashable | None, actual: Signature, predicted: Signature | None, where: str) -> None:
        """Keep ``actual``, the output signature of the input ``key`` (nothing for ``None``).

        Raises:
            RuntimeError: if ``predicted`` (what the step message announced) is not ``actual``, naming ``where``.
        """
        # a layout may change (sent as announced): only the shapes and dtypes must follow
        if predicted is not None and predicted != actual and _shapes(predicted) != _shapes(actual):
            raise RuntimeError(
                f"The output of {where} has the shapes and dtypes {_shown(actual)}, but an earlier step made"
                f" {_shown(predicted)} of an input of the same shapes. The pipeline tells the next stage each"
                " step's activation shapes before they are computed, learnt from the input shapes, so a backbone"
                " layer's output shape must follow from its input's shape, not from its values: pad or cut to a"
                " length that depends on the input's shape only."
            )
        if key is None:
            return
        self._known.pop(key, None)
        self._known[key] = actual
        if len(self._known) > self.LIMIT:
            del self._known[next(iter(self._known))]


def _in_graph(y: Value) -> bool:
    """Whether ``y`` has floating-point tensors and all of them require grad (where a boundary leaf made of one would
    require grad when it does not, the output cannot stand in for the boundary)."""
    floats = microbatch.floats(y)
    return bool(floats) and all(t.requires_grad for t in floats)


def _shapes(sig: Signature) -> tuple:
    """A signature's shapes and dtypes, without the layouts (the sender sends in the layout it announced)."""
    return sig[0], tuple((shape, dtype) for shape, dtype, _ in sig[1])


def _shown(sig: Signature) -> str:
    return ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype, _ in sig[1])


def _scattered_key(value: Value) -> Hashable | None:
    """What a scattered micro-batch's output shapes may follow from: its signature, and the values of the
    non-tensor items of a tuple (``None`` when one is not hashable)."""
    items = () if isinstance(value, Tensor) else tuple(item for item in value if not isinstance(item, Tensor))
    try:
        hash(items)
        return signature(value), items
    except (TypeError, ValueError):  # an item that is not hashable, a tensor that is not sent: nothing to learn
        return None
