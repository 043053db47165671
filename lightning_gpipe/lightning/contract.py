"""The user contract at the backbone call: one pipelined call per step, and the step ends there on early stages.

Every stage runs the user's step (``training_step``, ``validation_step``...) up to the backbone
call. That call runs the pipeline (:class:`BackboneCall`, installed in the stage's
:class:`~lightning_gpipe.engine.microbatch.Partition` as its ``backbone_call``); on every stage but the last it then
raises :class:`BackboneReached`, which ends the user's step there: the rest of the step (head, loss,
logging) belongs to the last stage. :meth:`BackboneCall.user_step` runs one step of the user's
under that contract and checks it called the backbone exactly once.

Under 1F1B (:meth:`BackboneCall.micro_batch_steps`) the step on the whole batch ends at the backbone
call on every stage, giving the backbone input; the stage's pipeline then runs the whole step, and the last
stage runs the user's step once more per micro-batch, on its rows of the batch, the backbone call
answering with that micro-batch's output (:mod:`lightning_gpipe.lightning.per_micro_batch`).

The part of a step before the backbone call runs alike on every stage and draws random numbers from the
stream the stages share; from the backbone call on, a stage draws from its own
(:class:`RandomStreams`; the adapter's is :class:`StageRandomness`, below).

**Random streams.** The data path must give every stage of a pipeline the same batch: the first stage feeds its rows
to the backbone, the last one pairs the backbone's output with the batch's labels. Whatever draws random numbers on the
way (a shuffling sampler without a seed of its own, the base seed of a DataLoader's workers, random augmentation
or masking in the main process, the user's data preparation before the backbone call) must therefore draw the
same numbers on every stage. The model's own draws (dropout in one stage's layers, a sampling head on the last
stage) differ from stage to stage by nature, and must not shift the data path's.

So each process keeps two streams of the generators that code draws from implicitly (torch's CPU and CUDA
generators, NumPy's and Python's ``random``, as :func:`lightning.fabric.utilities.seed.seed_everything` seeds):

- the **shared stream** is the process's ordinary global state. At the start of a run every process takes global
  rank 0's (:meth:`StageRandomness.synchronized`), and from then on only code that runs alike on every stage
  draws from it: Lightning's loops, the data loaders, the user's hooks and the part of a step before the
  backbone call;
- the **stage stream**, seeded from the run's seed and the pipeline rank, is swapped in for what one stage runs
  alone: its partition's forwards, recomputes and backwards, and on the last stage the rest of the user's step
  after the backbone call (head, loss) (:meth:`StageRandomness.stage`). Under fill-drain, where only Lightning's
  own code runs between ``training_step`` and ``backward`` (no hook in between is overridden:
  :func:`~lightning_gpipe.lightning.step.quiet_until_backward`), the stage stream stays in from the backbone call
  to the end of the drain: one exchange of the generators' states each way per step instead of two (most of an
  exchange's host time is NumPy's ``get_state``/``set_state``).

A pipeline of one stage keeps a single stream, so it draws exactly as one device does. With several stages,
dropout masks are independent between stages and reproducible for a given seed and number of stages, but not
equal to a single device's (one device draws every layer's masks from one stream, in layer order). The replicas
of one stage (data parallelism) share their seeds, as DDP's ranks do with ``seed_everything``.
"""

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext, suppress
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_gpipe.engine import Partition, Value
from lightning_gpipe.faults import Position
from lightning_gpipe.lightning import per_micro_batch
from lightning_gpipe.lightning._lightning import collect_rng_states, set_rng_states


class RandomStreams(Protocol):
    """A stage's random streams as the backbone call sees them: ``stage()`` is a context in which code draws from the
    stage's own stream (the backbone call and the rest of the step after it); outside it, from the stream the stages
    share."""

    def stage(self) -> AbstractContextManager[None]:
        """Draw from the stage's own stream inside the block."""


class OneStream:
    """One random stream for everything (one process, the bare engine): :meth:`stage` changes nothing."""

    def stage(self) -> AbstractContextManager[None]:
        """A block that draws from the one stream."""
        return nullcontext()


class StageRandomness:
    """The shared and the stage random stream of one stage process (see the module docstring).

    Args:
        states: the generator states the stage stream starts from (see :func:`stage_states`); ``None`` keeps one
            stream (a pipeline of one stage).
    """

    def __init__(self, states: dict[str, Any] | None = None) -> None:
        self._idle = states  # the stream not in use: the stage stream outside :meth:`stage`, the shared one inside
        self._depth = 0

    @classmethod
    def synchronized(
        cls, stage_index: int, num_stages: int, broadcast: Callable[[Any], Any] = lambda obj: obj
    ) -> "StageRandomness":
        """Give this process global rank 0's random state and seed its stage stream (a collective call).

        Args:
            stage_index: pipeline rank of this process.
            num_stages: K, the stages of the pipeline; with one stage the streams are one.
            broadcast: sends a picklable object from global rank 0 to every process and returns it (a collective
                call); the identity for a single process.
        """
        seed, states = broadcast((_run_seed(), collect_rng_states()))
        set_rng_states(states)
        return cls(stage_states(seed, stage_index) if num_stages > 1 else None)

    @contextmanager
    def stage(self) -> Iterator[None]:
        """Draw from this stage's own stream inside the block; the shared stream goes on where it was after it.

        Re-entrant: a nested block stays on the stage stream. When the block raises, its exception propagates even
        if putting the shared stream back fails too (e.g. an out-of-memory error left no room to copy the generator
        states): the failure board must name the step's error, and a failed step ends the run.
        """
        self._swap_in()
        try:
            yield
        except BaseException:
            with suppress(Exception):
                self._swap_out()
            raise
        self._swap_out()

    def _swap_in(self) -> None:
        self._depth += 1
        if self._depth == 1 and self._idle is not None:
            self._idle = _exchange(self._idle)

    def _swap_out(self) -> None:
        self._depth -= 1
        if self._depth == 0 and self._idle is not None:
            self._idle = _exchange(self._idle)


def stage_states(seed: int, stage_index: int) -> dict[str, Any]:
    """The generator states of the stage stream of pipeline rank ``stage_index`` in a run seeded with ``seed``,
    made without changing the current ones."""
    current = collect_rng_states()
    derived = int.from_bytes(hashlib.blake2b(f"{seed}/stage/{stage_index}".encode(), digest_size=8).digest(), "big")
    _seed_every_generator(derived)
    states = collect_rng_states()
    set_rng_states(current)
    return states


@contextmanager
def fixed_seed(seed: int = 0) -> Iterator[None]:
    """Draw from torch's, NumPy's and Python's generators seeded from ``seed`` inside the block, the same on every
    process; the states they had are put back after it, so the run draws as if the block had not run."""
    current = collect_rng_states()
    _seed_every_generator(seed)
    try:
        yield
    finally:
        set_rng_states(current)


def _seed_every_generator(seed: int) -> None:
    torch.manual_seed(seed >> 1)  # also seeds every CUDA device
    with suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)
    import random

    random.seed(seed)


def _exchange(states: dict[str, Any]) -> dict[str, Any]:
    """Install ``states`` and return the ones they replace."""
    current = collect_rng_states()
    set_rng_states(states)
    return current


def _run_seed() -> int:
    """The run's seed: ``seed_everything``'s when it was called, else the seed torch's generator started from."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()


class BackboneReached(BaseException):
    """Ends a user's step at the backbone call, on stages where the rest of the step does not run.

    A ``BaseException``, so that a user's ``except Exception`` cannot swallow it. Raised by
    :class:`BackboneCall` on stages before the last, and by the balance profiler's stand-in backbone
    (:mod:`lightning_gpipe.lightning.backbone`), which needs only the backbone's input.
    """


class PlanRunner(Protocol):
    """What runs this process's plan, as the contract sees it (:class:`lightning_gpipe.engine.StagePipeline`)."""

    @property
    def loss_per_micro_batch(self) -> bool:
        """Whether the plan calls a head per micro-batch (1F1B, zero-bubble), its cut at the end."""

    def forward(self, value: Value | None, head: Callable[[int, int, Value], None] | None = None) -> Any:
        """Run the plan up to its cut on the backbone input ``value``; on the last stage, the backbone output of the
        whole mini-batch (fill-drain, evaluation), or ``None`` after calling ``head(index, micro_batches, output)``
        for each micro-batch's loss."""


Answer = Callable[[Value], Value | None]
"""What answers a plain backbone call: the pipeline's forward, or a stand-in of
:meth:`BackboneCall.micro_batch_steps`."""


class BackboneCall:
    """The call a stage's :class:`~lightning_gpipe.engine.microbatch.Partition` goes through, and the step guard around
    it.

    Args:
        pipeline: what runs this process's plan (the engine's :class:`~lightning_gpipe.engine.StagePipeline`).
        is_last: whether this is the last stage, where the user's step goes on after the backbone call.
        share: sends a picklable object from the last stage to every stage of the pipeline and returns it
            (a collective call); the identity by default, for a single process.
        randomness: the stage's random streams; the backbone call and the rest of the step draw from the stage's
            own. One stream by default.
        position: the stage's position (its run's :attr:`lightning_gpipe.faults.job.Job.position`), moved before and
            after the backbone call; one nobody reads by default.
    """

    def __init__(
        self,
        pipeline: PlanRunner,
        is_last: bool,
        share: Callable[[Any], Any] = lambda obj: obj,
        randomness: Optional["RandomStreams"] = None,
        position: Position | None = None,
    ) -> None:
        self.pipeline, self.is_last, self.share = pipeline, is_last, share
        self.position = position if position is not None else Position()
        self._answer: Answer = pipeline.forward
        self._stage_stream = True  # whether a plain backbone call moves the step to the stage's stream
        self.randomness = randomness if randomness is not None else OneStream()
        self._plain = self._shared = 0
        self._hook = "training_step"
        self._rest_of_step: ExitStack | None = None  # what ends with the user's step (see `user_step`)
        self._kept = ExitStack()  # what a step kept open past its end (`user_step(keep=True)`), until `end_kept`

    def __call__(self, value: Value) -> Value | None:
        """The pipelined forward of the backbone input ``value`` (ignored on stages after the first).

        Returns:
            On the last stage, the backbone output of the whole mini-batch.

        Raises:
            BackboneReached: on every stage but the last, once its micro-batches are sent.
            RuntimeError: at once, before any transfer, for a second plain call in one step.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if self._plain:
            raise RuntimeError(
                f"`{self._hook}` called the pipelined backbone a second time in one step; it must call it exactly"
                " once per step (GPipeStrategy splits that one call into micro-batches, and the call ends the step on"
                " every stage but the last). Concatenate the inputs into one call, or, in evaluation, use"
                " `lightning_gpipe.forward_and_share` for each call."
            )
        self._plain += 1
        if self._rest_of_step is not None and self._stage_stream:
            self._rest_of_step.enter_context(self.randomness.stage())  # until the user's step ends
        output = self._answer(value)
        if not self.is_last:
            raise BackboneReached
        self.position.at(f"`{self._hook}` after the backbone call")
        return output

    def forward_and_share(self, value: Value, fn: Callable[[Value], Any]) -> Any:
        """Run the backbone on ``value`` without gradients, apply ``fn`` to its output on the last stage,
        and return ``fn``'s result on every stage. See :func:`forward_and_share`.

        Raises:
            RuntimeError: with gradients enabled, or after this step's plain backbone call.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        if torch.is_grad_enabled():
            raise RuntimeError(
                "`forward_and_share` runs the backbone without gradients, for evaluation and decoding; call it"
                " under `torch.no_grad()` or from `validation_step`, `test_step` or `predict_step`."
            )
        if self._plain:
            raise RuntimeError(
                "`forward_and_share` was called after this step's plain backbone call, which ends the step on"
                " every stage but the last; call the backbone plainly last, or only through `forward_and_share`."
            )
        self._shared += 1
        with self.randomness.stage():
            output = self.pipeline.forward(value)
            result = fn(output) if self.is_last else None
        return self.share(result)

    def micro_batch_steps(
        self,
        module: Any,
        hook: str,
        args: tuple,
        kwargs: dict,
        backward: Callable[[Tensor, bool], None],
    ) -> Any:
        """Run one training step whose schedule needs each micro-batch's loss before the next forwards (1F1B).

        Every stage runs the user's step on the whole batch up to its backbone call, which ends it there and
        gives the backbone input. The stage's pipeline then runs its whole plan, forwards and backwards. On the last
        stage, after each micro-batch's forward, the user's step runs again on that micro-batch's rows of the
        batch (``args[0]``, split by :func:`~lightning_gpipe.lightning.per_micro_batch.split_batch`), its backbone call
        returning the micro-batch's output; the loss it returns, times the micro-batch's share of the rows,
        goes to ``backward``. What the steps log and return is combined by
        :class:`~lightning_gpipe.lightning.per_micro_batch.RowWeighted` (row-weighted means).

        Args:
            module: the LightningModule, whose method ``hook`` is the step.
            hook: ``"training_step"``.
            args: the step's positional arguments; ``args[0]`` is the batch.
            kwargs: the step's keyword arguments.
            backward: backpropagates one weighted micro-batch loss to the micro-batch's output; its second argument
                says whether the micro-batch is the step's last.

        Returns:
            On the last stage, the combined output (see
            :meth:`~lightning_gpipe.lightning.per_micro_batch.RowWeighted.finish`); ``None`` on the others.

        Raises:
            TypeError, ValueError: on every stage alike before any micro-batch runs, for a batch whose tensors do
                not share dim 0 or a backbone input without the batch's rows (see
                :func:`~lightning_gpipe.lightning.per_micro_batch.batch_rows`).
            RuntimeError: if a step does not call the backbone exactly once, or a micro-batch's step returns no loss.
            PipelineFailure: if another stage failed while this one waited for it.
        """
        step, (batch, *rest) = getattr(module, hook), args
        rows = per_micro_batch.batch_rows(batch)
        results = per_micro_batch.RowWeighted(module, rows)
        captured: list[Value] = []
        parts: list[Any] = []
        with self._answering(lambda value: _capture(captured, value), stage_stream=False):
            results.run(0, lambda: self.user_step(hook, lambda: step(*args, **kwargs)))
        assert captured  # `user_step` raised if the step made no backbone call
        value = captured[0]
        per_micro_batch.check_input_rows(value, rows)

        def head(index: int, micro_batches: int, output: Value) -> None:
            if not parts:
                parts.extend(per_micro_batch.split_batch(batch, micro_batches))
            part, part_rows = parts[index], per_micro_batch.batch_rows(parts[index])
            with self._answering(lambda _: output):
                returned = results.run(part_rows, lambda: self.user_step(hook, lambda: step(part, *rest, **kwargs)))
            backward(per_micro_batch.loss_of(returned, hook, index) * (part_rows / rows), index == micro_batches - 1)

        with self.randomness.stage():
            self.pipeline.forward(value, head)
        return results.finish() if self.is_last else None

    @contextmanager
    def _answering(self, answer: Answer, stage_stream: bool = True) -> Iterator[None]:
        """Let ``answer`` answer the plain backbone calls inside the block; with ``stage_stream=False`` the step goes
        on drawing from the shared stream after the call (an answer that ends the step on every stage alike: no
        stage draws on its own, so swapping the streams in and out would only cost the host two exchanges)."""
        saved = self._answer, self._stage_stream
        self._answer, self._stage_stream = answer, stage_stream
        try:
            yield
        finally:
            self._answer, self._stage_stream = saved

    def user_step(self, hook: str, step: Callable[[], Any], keep: bool = False) -> Any:
        """Run one call of the user's ``hook`` (``"training_step"``...) as ``step()``, ending early stages at the
        backbone call.

        Args:
            hook: the step's name, for messages.
            step: runs the user's step.
            keep: keep what the backbone call started for the rest of the step (the stage's random stream) open
                after a step that returns, until :meth:`end_kept`: for a caller whose next code draws nothing and
                whose code after that is the stage's again (the drain). A step that raises ends it at once.

        Returns:
            The step's output on the last stage; ``None`` on the others.

        Raises:
            RuntimeError: if the step called the backbone more than once (at the second call), or never (plainly
                or through :func:`forward_and_share`).
        """
        self._plain = self._shared = 0
        self._hook = hook
        self.position.at(f"`{hook}` before the backbone call")
        outer = self._rest_of_step
        with ExitStack() as rest:
            self._rest_of_step = rest
            try:
                output = step()
            except BackboneReached:
                output = None
            finally:
                self._rest_of_step = outer
            if keep:
                self._kept.enter_context(rest.pop_all())
        if self._plain == 0 and self._shared == 0:
            raise RuntimeError(
                f"`{hook}` did not call the pipelined backbone; it must call it exactly once per step, on every stage"
                " alike (GPipeStrategy splits that one call into micro-batches, and the other stages wait for them)."
                " Call `self.backbone(...)` unconditionally, or skip the batch in the data instead."
            )
        return output

    def end_kept(self) -> None:
        """End what the last ``user_step(keep=True)`` kept open (nothing if none): back to the shared stream."""
        self._kept.close()


def _capture(captured: list, value: Value) -> None:
    """Answers the backbone call of a step on the whole batch: keeps the backbone input and ends the step there."""
    captured.append(value)
    raise BackboneReached


def forward_and_share(backbone: nn.Module, value: Value, fn: Callable[[Value], Any]) -> Any:
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
        PipelineFailure: if another stage failed while this one waited for it.
    """
    call = backbone.backbone_call if isinstance(backbone, Partition) else None
    if call is None:
        return fn(backbone(value))
    return call.forward_and_share(value, fn)


def check_automatic_optimization(module: Any) -> None:
    """Refuse a LightningModule with manual optimization, before any step.

    Raises:
        RuntimeError: if ``module.automatic_optimization`` is ``False``, naming the fix.
    """
    if not module.automatic_optimization:
        raise RuntimeError(
            "GPipeStrategy supports automatic optimization only: with `automatic_optimization = False` the"
            " user's step would have to run backward and the optimizer on every stage, but it stops at the"
            " backbone call on all stages but the last. Remove `self.automatic_optimization = False` and return"
            " the loss from `training_step`."
        )
