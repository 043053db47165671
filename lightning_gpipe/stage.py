"""One stage of the GPipe schedule: the fill (forward) and the drain (backward).

Fill: the first stage splits the backbone input into M micro-batches; every
stage runs each micro-batch through its partition and sends it on. The last
stage returns the concatenation of its outputs as detached boundary tensors
that require grad, so the user's loss runs once on the whole mini-batch.

Drain: micro-batches go backwards in reverse order. A stage receives the
gradient of its outputs (on the last stage: the boundary tensors' ``.grad``),
backpropagates through its partition, and sends its inputs' gradients back.
Parameter gradients accumulate over micro-batches, so the result equals
mini-batch training (GPipe, Huang et al. 2019, section 2.2).

Re-materialization (section 2.2, "activation checkpointing"): a checkpointed
micro-batch runs forward without autograd, keeping only its input; its forward
is recomputed in the drain *before* waiting for its gradient, so the recompute
overlaps with the next stage's backward of the same micro-batch.
"""

import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import Tensor

from lightning_gpipe import microbatch
from lightning_gpipe.events import Recorder
from lightning_gpipe.partition import Partition
from lightning_gpipe.transfer import Link, Meta

Value = Union[Tensor, tuple]

CHECKPOINT_MODES = ("always", "except_last", "never")


class Handoff(BaseException):
    """Raised by the backbone call on a stage that is not the last, ending the user's step there.

    The rest of the step (head, loss, logging) belongs to the last stage. It derives from
    ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """


@dataclass(frozen=True)
class MicroBatch:
    """The micro-batch a stage's layers are running on; see :func:`current_micro_batch`.

    Attributes:
        index: its position in the mini-batch, from 0.
        count: M, the micro-batches of this mini-batch (fewer than ``chunks`` for a batch with fewer rows).
        recompute: ``True`` for the drain's re-materialization of a forward that already ran in the fill.
    """

    index: int
    count: int
    recompute: bool = False


_current: ContextVar[Optional[MicroBatch]] = ContextVar("lightning_gpipe_micro_batch", default=None)


def current_micro_batch() -> Optional[MicroBatch]:
    """The micro-batch the calling layer runs on inside a stage, or ``None`` outside a pipelined forward.

    For layers whose forward has effects beyond its output, such as batch norm's running statistics
    (:class:`lightning_gpipe.batchnorm.DeferredBatchNorm`), which must happen once per mini-batch.
    """
    return _current.get()


@contextmanager
def _running(micro: MicroBatch) -> Iterator[None]:
    token = _current.set(micro)
    try:
        yield
    finally:
        _current.reset(token)


@dataclass
class _Record:
    """What the drain needs of one micro-batch."""

    input: Value
    output: Optional[Value]  # None when checkpointed: recomputed in the drain
    metas: list[Meta]  # shapes and dtypes of the floating-point outputs, whose gradients come back
    rng: Optional["_RngState"] = None
    boundary: list[Tensor] = field(default_factory=list)  # last stage: the leaves handed to the user's loss
    micro: MicroBatch = MicroBatch(0, 1)


class Stage:
    """Executes one stage's part of every step.

    Args:
        partition: this stage's layers.
        link: transfers to the neighbouring stages.
        index: pipeline rank of this stage (0-based).
        num_stages: K.
        chunks: M, micro-batches per mini-batch (fewer when the batch has fewer rows).
        checkpoint: ``"always"``, ``"except_last"`` (all micro-batches but the last) or ``"never"``.
        share: sends a picklable object from the last stage to every stage of the pipeline and returns it
            (a collective call); the identity by default, for a single process.
    """

    def __init__(
        self,
        partition: Partition,
        link: Link,
        index: int,
        num_stages: int,
        chunks: int,
        checkpoint: str,
        share: Callable[[Any], Any] = lambda obj: obj,
    ):
        self.partition, self.link, self.share = partition, link, share
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.chunks, self.checkpoint = chunks, checkpoint
        self._records: list[_Record] = []
        self._calls = self._shared_calls = 0
        self.events = Recorder()  # off unless a callback enables it; see lightning_gpipe.events
        self._filled = 0.0  # when the last stage's fill ended: its "loss" span runs from there to the drain
        partition.attach(self)

    @contextmanager
    def step(self, hook: str) -> Iterator[None]:
        """Wrap one call of the user's ``hook`` (``"training_step"``...): checks that it called the backbone once."""
        self._calls = self._shared_calls = 0
        yield
        if self._calls > 1 or (self._calls == 0 and self._shared_calls == 0):
            raise RuntimeError(
                f"`{hook}` called the pipelined backbone {self._calls} times; it must call it exactly once per step"
                " (GPipeStrategy splits that one call into micro-batches). To call it several times in evaluation,"
                " e.g. for autoregressive decoding, use `lightning_gpipe.forward_and_share`."
            )

    def forward_and_share(self, value: Value, fn: Callable[[Value], Any]) -> Any:
        """Run the backbone on ``value`` without gradients, apply ``fn`` to its output on the last stage,
        and return ``fn``'s result on every stage. See :func:`forward_and_share`.

        Raises:
            RuntimeError: with gradients enabled, or after this step's plain backbone call.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                "`forward_and_share` runs the backbone without gradients, for evaluation and decoding; call it"
                " under `torch.no_grad()` or from `validation_step`, `test_step` or `predict_step`."
            )
        if self._calls:
            raise RuntimeError(
                "`forward_and_share` was called after this step's plain backbone call, which ends the step on"
                " every stage but the last; call the backbone plainly last, or only through `forward_and_share`."
            )
        self._shared_calls += 1
        try:
            result = fn(self._fill(value))
        except Handoff:
            result = None
        return self.share(result)

    def forward(self, value: Value) -> Value:
        """The fill: run every micro-batch of the backbone input ``value`` through this stage.

        On stages after the first, ``value`` is ignored: the input arrives from the previous stage.

        Returns:
            On the last stage, the backbone output for the whole mini-batch.

        Raises:
            Handoff: on every stage but the last, once its micro-batches are sent.
        """
        self._calls += 1
        return self._fill(value)

    def _fill(self, value: Value) -> Value:
        training = torch.is_grad_enabled()
        self._records = []
        outputs = []
        for i, (x, count) in enumerate(self._micro_batches(value, training)):
            y = self._forward_one(x, i, count, training)
            if self.is_last:
                outputs.append(self._boundary(y, training))
            else:
                with self.events.span("send", i):
                    self.link.send_activation(y, i, count)
        if not training:
            with self.events.span("send"):
                self.link.flush()
        if not self.is_last:
            raise Handoff
        self._filled = time.perf_counter()
        return microbatch.join(outputs)

    def _micro_batches(self, value: Value, training: bool) -> Iterator[tuple[Value, int]]:
        """This stage's inputs with the micro-batch count: split from ``value``, or received."""
        if self.is_first:
            micro = microbatch.split(value, self.chunks)
            yield from ((x, len(micro)) for x in micro)
            return
        received, count = 0, 1
        while received < count:
            with self.events.span("recv", received):
                x, count = self.link.recv_activation()
            received += 1
            yield (_leaves(x) if training else x), count

    def _forward_one(self, x: Value, i: int, count: int, training: bool) -> Value:
        remat = training and self._checkpointed(i, count)
        rng = _RngState.capture(self.link.device) if remat else None
        micro = MicroBatch(i, count)
        memory_of = (self.partition, x) if training else None
        with torch.set_grad_enabled(training and not remat), _running(micro), self.events.span("forward", i, memory_of):
            y = self.partition.run(x)
        if training:
            metas = [(t.shape, t.dtype) for t in _floats(y)]
            self._records.append(_Record(x, None if remat else y, metas, rng, micro=micro))
        return y

    def _checkpointed(self, i: int, count: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and i < count - 1)

    def _boundary(self, y: Value, training: bool) -> Value:
        if not training:
            return y
        leaves = _leaves(y)
        self._records[-1].boundary = _floats(leaves)
        return leaves

    def backward(self) -> None:
        """The drain: backpropagate every micro-batch of the last fill, in reverse order.

        On the last stage, the user's loss must have been backpropagated to the
        boundary tensors first.
        """
        records, self._records = self._records, []
        if records and self.is_last:
            self.events.add("loss", None, self._filled, time.perf_counter())
        if records and not self.is_last:
            self.link.post_grads(records[-1].metas)
        while records:
            record = records.pop()
            i = len(records)
            output = record.output
            if output is None:
                with self.events.span("recompute", i, (self.partition, record.input)):
                    output = self._recompute(record)
            if records and not self.is_last:
                self.link.post_grads(records[-1].metas)  # one ahead, so it lands while this one computes
            outs = _floats(output)
            if self.is_last:
                grads = [b.grad for b in record.boundary]
            else:
                with self.events.span("recv", i):
                    grads = self.link.recv_grads()
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
            if pairs:
                with self.events.span("backward", i):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if not self.is_first:
                with self.events.span("send", i):
                    self.link.send_grads(
                        [x.grad if x.grad is not None else torch.zeros_like(x) for x in _floats(record.input)]
                    )
        with self.events.span("send"):
            self.link.flush()

    def _recompute(self, record: _Record) -> Value:
        with record.rng.restored(), torch.enable_grad(), _running(replace(record.micro, recompute=True)):
            return self.partition.run(record.input)


def forward_and_share(backbone: torch.nn.Module, value: Value, fn: Callable[[Value], Any]) -> Any:
    """Call ``backbone(value)``, apply ``fn`` to its output, and return the result on every stage.

    A pipelined backbone's output exists on the last stage only, and a plain backbone call ends
    the user's step on the other stages. Loops that feed an output back into the backbone, such as
    greedy or beam decoding, need that output everywhere: this runs the pipelined forward
    (micro-batched, no gradients), applies ``fn`` on the last stage and sends its result (keep it
    small, e.g. the next token ids) to every stage, so all stages go round the loop together. The
    same approach as Megatron-LM's text generation, which broadcasts new tokens from the last stage.
    Without a pipeline (one device, other strategies) it is ``fn(backbone(value))``.

    Args:
        backbone: the module's backbone attribute (``self.backbone``).
        value: the backbone input, as for a plain call.
        fn: maps the backbone output of the whole batch to a picklable result.

    Raises:
        RuntimeError: with gradients enabled, or when called after the step's plain backbone call.
    """
    stage = backbone.stage if isinstance(backbone, Partition) else None
    if stage is None:
        return fn(backbone(value))
    return stage.forward_and_share(value, fn)


class _RngState:
    """The random number generator state a checkpointed forward started from, so the recompute draws the same."""

    def __init__(self, device: torch.device, cpu: Tensor, accelerator: Optional[Tensor]) -> None:
        self.device, self.cpu, self.accelerator = device, cpu, accelerator

    @classmethod
    def capture(cls, device: torch.device) -> "_RngState":
        accelerator = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(device, torch.get_rng_state(), accelerator)

    @contextmanager
    def restored(self) -> Iterator[None]:
        devices = [self.device] if self.accelerator is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.accelerator is not None:
                torch.cuda.set_rng_state(self.accelerator, self.device)
            yield


def _floats(value: Value) -> list[Tensor]:
    tensors = [value] if isinstance(value, Tensor) else value
    return [t for t in tensors if isinstance(t, Tensor) and t.is_floating_point()]


def _leaves(value: Value) -> Value:
    """Detached copies of ``value``'s tensors; floating-point ones require grad (they receive gradients)."""

    def leaf(t):
        if not isinstance(t, Tensor):
            return t
        return t.detach().requires_grad_(t.is_floating_point())

    return leaf(value) if isinstance(value, Tensor) else tuple(leaf(t) for t in value)
