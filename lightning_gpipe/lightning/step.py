"""How one training step runs through Lightning's hooks: the two step protocols, side by side.

Lightning's automatic optimization calls ``strategy.training_step``, then (on the first batch of an accumulation
window) the optimizer's ``zero_grad``, then ``strategy.backward``, then the optimizer step. A stage's plan has one
cut: the stage's pipeline runs the actions before it in ``training_step`` and the rest in ``backward``
(:meth:`~lightning_gpipe.engine.StagePipeline.forward`, :meth:`~lightning_gpipe.engine.StagePipeline.backward`).
Where the user's loss runs decides where the cut is, and so which of two protocols a schedule follows:

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
"""

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_gpipe.lightning._lightning import backward_skipped, closure_result, logged_results
from lightning_gpipe.lightning.relay import share_step_output
from lightning_gpipe.lightning.run import StageRun


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
        return user_step(run, module, "training_step", precision.train_step_context, args, kwargs, keep=keep)

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
                with precision.train_step_context(), run.job.board.reporting():
                    run.pipeline.backward()  # recomputes as the fill did
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

        with precision.train_step_context(), run.job.board.reporting():
            with run.step_gradients.computing(list(module.parameters()), zeroed_after=zeroed):
                return run.backbone_call.micro_batch_steps(module, "training_step", args, kwargs, backward)

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


def agree(run: StageRun, trainer: "pl.Trainer", agree_step: Callable[[Tensor | None], np.ndarray]) -> None:
    """At the end of ``strategy.backward``: the step's agreement (``agree_step``, one all-reduce on the CPU group,
    see :class:`~lightning_gpipe.lightning.agreement.StepAgreement`), whose region carries the last stage's
    description of its logged values and output, then their tensors (:class:`~lightning_gpipe.lightning.relay.
    StepRelay`): every stage then holds the last stage's logged values before Lightning's loop reads them.

    Raises:
        BatchMismatchError: on every process, if the stages of a pipeline read different batches.
        PipelineFailure: if another stage failed while this one waited for it.
    """
    relay = run.step_relay
    if run.pipeline.num_stages == 1:
        agree_step(None)
        return
    results = logged_results(trainer)
    results = results if results is not None else {}
    words = relay.pack(results, relay.output) if relay.is_src else torch.empty(0, dtype=torch.int64)
    relay.exchange(agree_step(words), trainer)


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
    (:meth:`~lightning_gpipe.lightning.run.StageRun.finish_backward`), so that ``on_after_backward`` sees each
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
    with context(), run.job.board.reporting():
        return run.backbone_call.user_step(hook, lambda: step(*args, **kwargs), keep=keep)


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
