"""This process's stage for one run, and how one training step runs through Lightning's hooks.

:func:`~lightning_gpipe.lightning.build.build_stage` builds a :class:`StageRun` at the strategy's setup: this
process's part of the pipeline (the engine's door) and what Lightning adds to it. The strategy's hooks hand it
their work through the two step protocols below, and :meth:`StageRun.close` undoes the split at teardown.

One training step: Lightning's automatic optimization calls ``strategy.training_step``, then (on the first batch
of an accumulation window) the optimizer's ``zero_grad``, then ``strategy.backward``, then the optimizer step. A
stage's plan has one cut: the stage's pipeline runs the actions before it in ``training_step`` and the rest in
``backward`` (:meth:`~lightning_gpipe.engine.StagePipeline.forward`,
:meth:`~lightning_gpipe.engine.StagePipeline.backward`). Where the user's loss runs decides where the cut is, and
so which of two protocols a schedule follows:

    ==================  ========================================  ==============================================
    Lightning calls     FillDrain (``"gpipe"``)                   PerMicroBatch (``"1f1b"``, zero-bubble)
    ==================  ========================================  ==============================================
    ``training_step``   the user's step runs up to the backbone   the user's step runs on the whole batch up to
                        call, which runs the plan up to its cut   the backbone call, which keeps the backbone
                        (the fill) and ends the step on every     input and ends the step on every stage; then
                        stage but the last; there it returns the  the whole plan runs (its cut is at its end):
                        whole mini-batch's output and the step    at each ``loss`` action the last stage runs the
                        goes on (head, loss, ``self.log``) once   user's step again on the micro-batch's rows
                                                                  (its backbone call answered by the micro-batch's
                                                                  output) and backpropagates its loss, weighted
                                                                  by its share of the rows; the gradients are
                                                                  kept apart from ``.grad`` (``StepGradients``)
    ``zero_grad``       zeroes the previous step's gradients      the step's gradients are not in ``.grad`` yet
    ``backward``        the last stage backpropagates the loss    the step's gradients are added to ``.grad``
                        to its boundary (through the precision
                        plugin); every stage runs the rest of
                        the plan: the drain
    optimizer step      Lightning's, with clipping over every     the same
                        stage (``optimization``)
    ==================  ========================================  ==============================================

Both end ``training_step`` with the last stage's output on every stage (:func:`~lightning_gpipe.lightning.relay.
share_step_output`) and ``backward`` with its logged values on every stage (:class:`~lightning_gpipe.lightning.
relay.LogRelay`). Evaluation (validation, test, predict) runs fill-drain's fill whatever the schedule
(:func:`evaluation_step`). docs/how-it-works.md shows the same table with the hooks' call chains.

Autocast's casts of the weights, made once per step instead of once per micro-batch: under ``precision="bf16-mixed"``
or ``"16-mixed"`` every floating-point weight a layer uses is cast to the lower precision where the layer runs.
torch's autocast keeps the cast of a leaf tensor that requires grad (a weight) for the rest of the outermost autocast
region, so a plain PyTorch loop that runs M micro-batches inside one region casts each weight once per step.
Lightning 2.6 turns that cache off (``MixedPrecision.autocast_context_manager`` passes ``cache_enabled=False``, a
workaround for torch's cache losing gradients after a ``no_grad`` forward, Lightning-AI/pytorch-lightning#20644),
which costs nothing where a step calls each layer once; a pipeline calls each layer once per micro-batch, so every
weight was cast M times per step, and each micro-batch's graph kept its own low-precision copy of every weight until
its backward (the figures: docs/benchmarks.md, "Host synchronisations and casts"). :func:`step_casts_cached` turns
the cache back on for the regions of a pipeline step (the precision plugin's step context), where the installed
torch keeps gradients through a cast first made under ``no_grad`` (pytorch/pytorch#165068, which re-materialized
micro-batches and users' own ``no_grad`` forwards need): :func:`cache_keeps_gradients` checks that once per process,
on the CPU. The values and gradients are the same as without the cache: the cast is computed once and shared by the
micro-batches' graphs, each of which backpropagates through it into the weight's ``.grad``.
"""

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_gpipe.engine import Partition, Recorder, StagePipeline, StepGradients, TiedParameters, materialize
from lightning_gpipe.faults import Job
from lightning_gpipe.lightning import state_dict
from lightning_gpipe.lightning._lightning import backward_skipped, closure_result, logged_results
from lightning_gpipe.lightning.agreement import RunAgreement
from lightning_gpipe.lightning.contract import BackboneCall, StageRandomness
from lightning_gpipe.lightning.current_values import bring_current, held_names, mark_current, module_values
from lightning_gpipe.lightning.data_parallel import FullyShardedStage, GradientSync
from lightning_gpipe.lightning.relay import LogRelay, StepRelay, share_step_output
from lightning_gpipe.lightning.tensor_parallel import TensorSplit

T = TypeVar("T")


@dataclass
class StageRun:
    """This process's part of one run (see the module docstring).

    Args:
        pipeline: this process's part of the pipeline (the engine's door).
        backbone_call: the call the partition goes through (installed as ``partition.backbone_call``).
        relay: copies the last stage's logged values to every stage (evaluation steps, epoch-end hooks).
        step_relay: the last stage's logged values and output in training steps.
        randomness: the stage's random streams (see :class:`~lightning_gpipe.lightning.contract.StageRandomness`).
        share: sends a picklable object from the last stage to every stage of the pipeline (a collective call).
        job: the run's :class:`~lightning_gpipe.faults.job.Job` (failure board, position, watchdog, waits).
        gradient_sync: DDP over the stage's replicas, with several of them (set by :meth:`sync_gradients`).
        fsdp: FSDP2 over the stage's replicas instead, with a ``sharding_strategy`` (set by :meth:`sync_gradients`).
        tensor_split: the split of the stage's layers over its tensor ranks, with ``tensor_parallel_size > 1`` (set
            by :meth:`split_tensors`).
        step_gradients: a 1F1B step's gradients, kept apart until Lightning's ``backward``.
        collector: what the pipeline callbacks (:mod:`lightning_gpipe.lightning.callbacks`) record of this run's steps,
            shared by all of them; the first one that needs it sets it.
        kept: the module's current values kept across the split, until :meth:`start` has sent them where they are
            stale (:func:`~lightning_gpipe.lightning.current_values.kept_values`).
    """

    pipeline: StagePipeline
    backbone_call: BackboneCall
    relay: LogRelay
    step_relay: StepRelay
    randomness: StageRandomness
    share: Callable[[Any], Any]
    job: Job
    gradient_sync: GradientSync | None = None
    fsdp: FullyShardedStage | None = None
    tensor_split: TensorSplit | None = None
    step_gradients: StepGradients = field(default_factory=StepGradients)
    collector: Any = None
    kept: dict[str, Tensor] = field(default_factory=dict)

    @property
    def partition(self) -> Partition:
        """Every backbone layer this stage holds, under its original names (all its model chunks')."""
        return self.pipeline.partition

    @property
    def ties(self) -> TiedParameters:
        """The parameters this stage shares with others."""
        return self.pipeline.ties

    @property
    def events(self) -> Recorder:
        """The stage's recorder, which every model chunk's spans go to (marked with their model chunk)."""
        return self.pipeline.events

    def sync_gradients(
        self,
        module: "pl.LightningModule",
        replicas: DeviceMesh,
        device: torch.device,
        sharding: str | None = "NO_SHARD",
    ) -> None:
        """Let DDP average this stage's gradients over its ``replicas`` (a 1-D mesh, :func:`~lightning_gpipe.engine.
        replicas_mesh`; several replicas only; see
        :mod:`lightning_gpipe.lightning.data_parallel`): what the stage trains is its partition, and on the last stage
        also the modules after the backbone. The sync starts at the step's last backward on the stage
        (:meth:`~lightning_gpipe.engine.StagePipeline.on_last_backward`); the other model chunks' parameters are
        complete by then, and DDP reduces them with the first bucket. With a ``sharding`` other than ``"NO_SHARD"``
        (``None`` means it), FSDP2 shards what the stage holds over ``replicas`` instead
        (:class:`~lightning_gpipe.lightning.data_parallel.FullyShardedStage`), keeping the gathered parameters from the
        stage's first backward of a step (:meth:`~lightning_gpipe.engine.StagePipeline.on_backward_start`) to its end.
        A collective call of the replicas."""
        trained = module if self.pipeline.is_last else self.partition
        if sharding not in (None, "NO_SHARD"):
            if any(True for _ in trained.parameters()):
                full = sharding == "FULL_SHARD"
                self.fsdp = FullyShardedStage(trained, self.pipeline.partitions, replicas, full, self.job)
                self.pipeline.on_backward_start(self.fsdp.begin_backward)
            return
        if not GradientSync.trains(trained):
            return
        self.gradient_sync = GradientSync(trained, replicas.get_group(), device)
        if GradientSync.trains(self.partition):
            self.pipeline.on_last_backward(self.gradient_sync.prepare)

    def start(self, module: "pl.LightningModule", device: torch.device) -> None:
        """Initialise the stage's layers on ``device`` if ``module`` was created on the meta device (see
        :func:`~lightning_gpipe.engine.partition.materialize`), with the stage's random stream; give the tensors whose
        values a previous run left stale here their current values (:func:`~lightning_gpipe.lightning.current_values.
        bring_current`, a collective call); and relay what the module's epoch-end hooks log. Once the run exists, so
        that :meth:`close` undoes the split if this fails.

        Raises:
            ValueError: if a layer created on the meta device cannot be initialised.
            RuntimeError: if a tensor's latest value is on no process.
        """
        with self.randomness.stage():  # each stage initialises its own layers
            materialize(module, device)
        bring_current(module, self.kept, self.job)
        self.kept = {}
        self.relay.relay_after_epoch_end_hooks(module)

    @contextmanager
    def no_gradient_sync(self) -> Iterator[None]:
        """Within a gradient-accumulation window, accumulate without averaging over the replicas (Lightning's loop
        enters this for every batch of the window but the last). Under a schedule with a loss per micro-batch (1F1B)
        every batch's gradients are averaged: they are computed apart from the window's earlier ones (see
        :class:`~lightning_gpipe.engine.gradients.StepGradients`), and the average of a sum is the sum of the
        averages. With sharding, FSDP2 keeps the window's gradients unsharded apart from ``.grad`` under every plan,
        and reduce-scatters them once, at the window's end."""
        sync = self.gradient_sync
        if self.fsdp is not None:  # FSDP2 keeps the window's gradients to itself, whatever the plan
            with self.fsdp.disabled():
                yield
            return
        with nullcontext() if sync is None or self.pipeline.loss_per_micro_batch else sync.disabled():
            yield

    def announce_loss_backward(self, loss: Tensor) -> None:
        """On the last stage, announce the step's last backward to the gradient sync when it is the loss's
        (:attr:`~lightning_gpipe.engine.StagePipeline.loss_ends_backward`)."""
        if self.gradient_sync is not None and self.pipeline.loss_ends_backward:
            self.gradient_sync.prepare([loss])

    def begin_step(self) -> None:
        """At the start of a step (training or evaluation), with sharding: gather what FSDP2 does not gather in the
        micro-batches (see :meth:`~lightning_gpipe.lightning.data_parallel.FullyShardedStage.begin_step`)."""
        if self.fsdp is not None:
            self.fsdp.begin_step()

    def finish_backward(self) -> None:
        """At the end of a training step's backward, with sharding: the step's reduce-scatter (not within a
        gradient-accumulation window) and the gathered parameters freed (see
        :meth:`~lightning_gpipe.lightning.data_parallel.FullyShardedStage.finish_backward`)."""
        if self.fsdp is not None:
            self.fsdp.finish_backward()

    def end_evaluation_step(self) -> None:
        """After an evaluation step, with sharding: the gathered parameters freed."""
        if self.fsdp is not None:
            self.fsdp.end_evaluation_step()

    def split_tensors(
        self, module: "pl.LightningModule", configure_model: Callable[[], None] | None, stage: str
    ) -> None:
        """Split the stage's layers over its tensor ranks by the module's deferred ``configure_model`` (see
        :class:`~lightning_gpipe.lightning.tensor_parallel.TensorSplit`), after the split and before
        :meth:`sync_gradients`.

        Raises:
            ValueError: if ``configure_model`` split a layer this stage does not hold.
        """
        self.tensor_split = TensorSplit(module, configure_model, stage)

    def unshard(self) -> None:
        """With sharding or tensor parallelism, after a completed fit: every parameter whole again and FSDP2 and the
        tensor split undone, so the module leaves the run plain (see :meth:`~lightning_gpipe.lightning.data_parallel.
        FullyShardedStage.release`, :meth:`~lightning_gpipe.lightning.tensor_parallel.TensorSplit.undo`). A
        collective call of the stage's replicas and tensor ranks."""
        if self.fsdp is not None:
            self.fsdp.release()
            self.fsdp = None
        if self.tensor_split is not None:
            self.tensor_split.undo()
            self.tensor_split = None

    def whole_state(self, module: "pl.LightningModule", pipeline: int, group: Any) -> dict | None:
        """Every stage's part of ``module``'s values, its state dict and the buffers no state dict holds
        (:func:`~lightning_gpipe.lightning.current_values.module_values`), on the process of pipeline ``pipeline``
        (the replica without tensor parallelism) that gets the whole model back (see
        :func:`~lightning_gpipe.lightning.state_dict.whole_on_rank_zero`; ``None`` elsewhere): a collective call over
        the pipeline's ``group``."""
        values = {name: value.detach() for name, value in module_values(module).items() if not value.is_meta}
        return state_dict.whole_on_rank_zero(values, pipeline, group, self.job)

    def close(self, module: "pl.LightningModule", whole: dict[str, Any] | None, release_groups: bool) -> None:
        """Undo the split (see :meth:`~lightning_gpipe.engine.StagePipeline.close`; ``whole``: every stage's state, on
        the process that gets the whole model back; ``release_groups``: destroy the pipeline's process groups, once
        no process uses them), the relay's hooks, and put back the shared random stream (if a step that failed kept
        the stage's), recording which of the module's values are current on this process for a later run
        (:func:`~lightning_gpipe.lightning.current_values.mark_current`)."""
        held = held_names(module)
        self.backbone_call.end_kept()
        LogRelay.unwrap_epoch_end_hooks(module)
        self.pipeline.close(whole, release_groups)
        mark_current(module, None if whole is not None else held)


class FillDrain:
    """The step of a plan whose loss runs once on the whole mini-batch, between the fill and the drain (GPipe's
    fill-drain: ``schedule="gpipe"``, looped under ``virtual_stages``). See the module docstring."""

    @staticmethod
    def training_step(run: StageRun, module: "pl.LightningModule", precision: Any, args: tuple, kwargs: dict) -> Any:
        """The fill and, on the last stage, the rest of the user's step; the user's output on the last stage.

        Where nothing between this step and its ``backward`` can draw random numbers (:func:`quiet_until_backward`),
        the stage's random stream the backbone call moved to stays in place until the drain has ended: one exchange
        of the generators' states each way per step instead of two.
        """
        keep = run.pipeline.num_stages > 1 and quiet_until_backward(module)  # one stage: one stream, nothing to keep
        context = lambda: _train_step_context(precision)  # noqa: E731
        return user_step(run, module, "training_step", context, args, kwargs, keep=keep)

    @staticmethod
    def backward(run: StageRun, module: "pl.LightningModule", precision: Any, loss: Tensor, *args: Any, **kw) -> None:
        """The last stage backpropagates ``loss`` to its boundary through the precision plugin (``args``: the
        optimizer and what follows it in ``Precision.backward``), so loss scaling applies to the whole pipeline;
        then every stage drains its micro-batches."""
        try:
            with run.randomness.stage():  # the loss's backward and the drain draw from the stage's stream
                if run.pipeline.is_last:
                    run.announce_loss_backward(loss)
                    precision.backward(loss, module, *args, **kw)
                with _train_step_context(precision):
                    _reported(run, run.pipeline.backward)  # recomputes as the fill did
        finally:
            run.backbone_call.end_kept()  # the fill's stream region, if training_step kept it: the shared one again


class PerMicroBatch:
    """The step of a plan whose last stage needs each micro-batch's loss during the step (``"1f1b"``, ``"zb-h1"``,
    ``"zb-1p"``, ``"zb-v"``): the whole plan runs in ``training_step``. See the module docstring."""

    @staticmethod
    def training_step(run: StageRun, module: "pl.LightningModule", precision: Any, args: tuple, kwargs: dict) -> Any:
        """The whole plan (see :meth:`~lightning_gpipe.lightning.contract.BackboneCall.micro_batch_steps`); its
        gradients are kept apart until Lightning's ``backward`` (which zeroes the previous step's in between, on
        the first batch of an accumulation window: those are freed at once). The combined output on the last
        stage."""
        trainer = module.trainer
        run.job.position.begin_step(f"step {trainer.global_step}")
        zeroed = trainer.fit_loop.epoch_loop.batch_idx % trainer.accumulate_grad_batches == 0  # as Lightning's loop

        def backward(loss: Tensor, last: bool) -> None:
            _backward_micro_batch(run, module, precision, loss, last)

        def steps() -> Any:
            with run.step_gradients.computing(list(module.parameters()), zeroed_after=zeroed):
                return run.backbone_call.micro_batch_steps(module, "training_step", args, kwargs, backward)

        with _train_step_context(precision):
            return _reported(run, steps)

    @staticmethod
    def backward(run: StageRun, module: "pl.LightningModule", precision: Any, loss: Tensor, *args: Any, **kw) -> None:
        """The step's gradients, computed in ``training_step``, added to ``.grad``."""
        run.step_gradients.hand_over()


Protocol = type[FillDrain] | type[PerMicroBatch]


def protocol_of(run: StageRun) -> Protocol:
    """The step protocol of ``run``'s plans: :class:`PerMicroBatch` when they call a head per micro-batch."""
    return PerMicroBatch if run.pipeline.loss_per_micro_batch else FillDrain


def training_step(run: StageRun, module: "pl.LightningModule", precision: Any, args: tuple, kwargs: dict) -> Any:
    """``strategy.training_step``: the plan up to its cut under the run's protocol (:func:`protocol_of`). Every
    stage returns the last stage's output, the user's loss or the dict holding it, so that callbacks see the step's
    loss on every rank (see :func:`~lightning_gpipe.lightning.relay.share_step_output`). ``precision``: the precision
    plugin.

    Raises:
        TypeError, ValueError: under a loss per micro-batch, for a batch or backbone input that cannot be split by
            rows.
        RuntimeError: if the user's step does not call the backbone exactly once, or returns no loss on the last
            stage.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    run.begin_step()
    output = protocol_of(run).training_step(run, module, precision, args, kwargs)
    is_last, relay = run.pipeline.is_last, run.step_relay
    if is_last and output is None:
        raise RuntimeError(
            "`training_step` returned None on the last stage; under GPipeStrategy every step must return its"
            " loss, since all stages take part in the drain."
        )
    if run.pipeline.num_stages == 1:
        return output
    if is_last:
        relay.output = output
    if relay.shaped:  # shaped like the last step's: the loss now, the rest with the logged values
        return relay.share_loss(output)
    return share_step_output(output, is_last, run.share, run.pipeline.device)


def agree(run: StageRun, trainer: "pl.Trainer", agreement: RunAgreement) -> None:
    """At the end of ``strategy.backward``: the step's agreement (one all-reduce on the CPU group, see
    :meth:`~lightning_gpipe.lightning.agreement.RunAgreement.end_training_step`), whose region carries the last stage's
    description of its logged values and output, then their tensors (:class:`~lightning_gpipe.lightning.relay.
    StepRelay`): every stage then holds the last stage's logged values before Lightning's loop reads them.

    Raises:
        BatchMismatchError: on every process, if the stages of a pipeline read different batches.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    relay, epoch = run.step_relay, trainer.current_epoch
    if run.pipeline.num_stages == 1:
        agreement.end_training_step(epoch, None)
        return
    results = logged_results(trainer)
    results = results if results is not None else {}
    words = relay.pack(results, relay.output) if relay.is_src else torch.empty(0, dtype=torch.int64)
    relay.exchange(agreement.end_training_step(epoch, words), trainer)


def hand_output(run: StageRun, closure: Any) -> None:
    """After the optimizer step's closure, on a stage before the last whose step returned an output shaped like
    the last step's (:meth:`~lightning_gpipe.lightning.relay.StepRelay.share_loss`) when the last stage's came out
    shaped otherwise (other keys, other shapes): the step's output Lightning hands to ``on_train_batch_end`` becomes
    the last stage's (its ``Closure``'s result). Outside an optimizer step (the first batches of a
    gradient-accumulation window) the output keeps the last step's shape, its loss the last stage's."""
    relay, result = run.step_relay, closure_result(closure)
    if relay.is_src or not relay.reshaped or result is None or run.pipeline.num_stages == 1:
        return
    output = relay.output
    if isinstance(output, Mapping):
        result.loss = output["loss"].detach().clone()
        result.extra = {key: value for key, value in output.items() if key != "loss"}
    else:
        result.loss, result.extra = output.detach().clone(), {}


def backward(run: StageRun, module: "pl.LightningModule", precision: Any, loss: Tensor, *args: Any, **kw: Any) -> None:
    """``strategy.backward``, between the precision plugin's ``pre_backward`` and ``post_backward``: the plan after
    its cut under the run's protocol (:func:`protocol_of`); then, with sharding, the step's reduce-scatter
    (:meth:`StageRun.finish_backward`), so that ``on_after_backward`` sees each
    replica's shard of the averaged gradients, as DDP's hooks see the average.

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    protocol_of(run).backward(run, module, precision, loss, *args, **kw)
    run.finish_backward()


def evaluation_step(
    run: StageRun, module: "pl.LightningModule", hook: str, context: Callable, args: tuple, kwargs: dict
) -> Any:
    """A pipelined forward of the user's ``hook`` (``"validation_step"``, ``"test_step"`` or ``"predict_step"``)
    within the precision plugin's ``context``. Returns the user's output on the last stage (``None`` elsewhere), or
    for predict the last stage's prediction on every stage; then relays the last stage's logged values.

    Raises:
        RuntimeError: if the user's step does not call the backbone exactly once (plainly or through
            :func:`~lightning_gpipe.forward_and_share`).
        PipelineFailure: if another stage failed while this one waited for it.
    """
    run.begin_step()
    output = user_step(run, module, hook, context, args, kwargs)
    run.end_evaluation_step()
    if hook == "predict_step":
        return run.share(output)
    run.relay(module.trainer)
    return output


def user_step(
    run: StageRun,
    module: "pl.LightningModule",
    hook: str,
    context: Callable,
    args: tuple,
    kwargs: dict,
    keep: bool = False,
) -> Any:
    """One call of the user's ``hook`` with ``args`` and ``kwargs`` within ``context``, ending at the backbone call
    on all stages but the last; ``keep``: the stage's random stream stays in place after it (see
    :meth:`~lightning_gpipe.lightning.contract.BackboneCall.user_step`). What an earlier step kept and no ``backward``
    ended (a failed one) ends first: the step starts on the shared stream."""
    run.backbone_call.end_kept()
    step = getattr(module, hook)
    run.job.position.begin_step(f"step {module.trainer.global_step}")
    with context():
        return _reported(run, lambda: run.backbone_call.user_step(hook, lambda: step(*args, **kwargs), keep=keep))


def _reported(run: StageRun, call: Callable[[], T]) -> T:
    """``call()``; an exception it raises is published on the job's failure board at once (before Lightning's
    exception hooks run, :meth:`~lightning_gpipe.faults.failure.FailureBoard.report`), then let through."""
    try:
        return call()
    except BaseException as exception:
        run.job.board.report(exception)
        raise


_MODULE_HOOKS_BEFORE_BACKWARD = ("on_before_zero_grad", "optimizer_zero_grad", "on_before_backward")
_CALLBACK_HOOKS_BEFORE_BACKWARD = ("on_before_zero_grad", "on_before_backward")


def quiet_until_backward(module: "pl.LightningModule") -> bool:
    """Whether, in this training step, only Lightning's own code runs between ``training_step`` and the strategy's
    ``backward``, which draws no random numbers: automatic optimization with its backward not skipped (as
    ``StochasticWeightAveraging`` does in its last epoch), and neither the module nor a callback overrides the hooks
    Lightning calls in between (``on_before_zero_grad``, ``optimizer_zero_grad``, ``on_before_backward``; in its
    class or on the instance, as ``LambdaCallback`` does)."""
    trainer = module.trainer
    if not module.automatic_optimization or backward_skipped(trainer):
        return False
    if any(is_overridden(hook, module, pl.LightningModule) for hook in _MODULE_HOOKS_BEFORE_BACKWARD):
        return False
    hooks = _CALLBACK_HOOKS_BEFORE_BACKWARD
    return not any(is_overridden(hook, callback, pl.Callback) for callback in trainer.callbacks for hook in hooks)  # type: ignore[attr-defined]  # Lightning's callback connector sets it


def _backward_micro_batch(
    run: StageRun, module: "pl.LightningModule", precision: Any, loss: Tensor, last: bool
) -> None:
    """Backpropagate one micro-batch's weighted loss as Lightning's backward does a step's: divided by
    ``accumulate_grad_batches``, scaled by the precision plugin's gradient scaler if it has one, through
    ``LightningModule.backward``; without the step's ``on_before_backward`` hooks, which Lightning's ``backward``
    runs. ``last``: whether it is the step's last micro-batch."""
    if last:
        run.announce_loss_backward(loss)
    loss = loss / module.trainer.accumulate_grad_batches
    scaler = getattr(precision, "scaler", None)
    precision.backward(scaler.scale(loss) if scaler is not None else loss, module, None)


@functools.cache
def cache_keeps_gradients() -> bool:
    """Whether the installed torch's autocast cache keeps a weight's gradient when the weight was first cast under
    ``no_grad`` (true from pytorch/pytorch#165068 on). Checked once per process with a 2 x 2 ``Linear`` under CPU
    autocast (the cache's code is the same for every device)."""
    with torch.inference_mode(False), torch.enable_grad():
        layer = torch.nn.Linear(2, 2)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            with torch.no_grad():
                layer(torch.ones(1, 2))
            return layer(torch.ones(1, 2)).requires_grad


@contextmanager
def step_casts_cached() -> Iterator[None]:
    """Keep autocast's casts of the weights inside this region until the enclosing autocast region ends (for a
    pipeline step: the precision plugin's step context), where :func:`cache_keeps_gradients`; else change nothing.

    The region must not change a weight in place between two uses of it: a cached cast would not see the change
    (torch's own default, as in a plain loop under ``torch.autocast``).
    """
    if not cache_keeps_gradients():
        yield
        return
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


@contextmanager
def _train_step_context(precision: Any) -> Iterator[None]:
    """The precision plugin's training-step context (autocast under mixed precision), in which each weight is cast
    once per step, not once per micro-batch (:func:`step_casts_cached`)."""
    with precision.train_step_context(), step_casts_cached():
        yield
