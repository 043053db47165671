"""Make what user code logs on the last stage known to every stage.

Only the last stage runs the part of a step after the backbone call, so only its
``self.log`` calls record values. Loggers write on global rank 0 (the first
stage), the progress bar shows there, and callbacks such as ``ModelCheckpoint``
and ``EarlyStopping`` read ``trainer.callback_metrics`` on every rank and must
decide alike. So after every step, and after the user's epoch-end hooks, the last
stage broadcasts its logged results to the other stages of its pipeline (Lightning's ``_ResultCollection`` entries,
with their accumulated epoch state) and every other stage takes them as its own.

What ``training_step`` returns reaches the other stages too (:func:`share_step_output`), so that a callback's
``on_train_batch_end(outputs=...)`` sees the step's real loss on every rank.
"""

import io
import pickle
from typing import TYPE_CHECKING, Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_gpipe.faults import collectives

if TYPE_CHECKING:
    from lightning_gpipe.faults.job import Job

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


class LogRelay:
    """Copies the last stage's logged results to every stage.

    Args:
        strategy: the running strategy; values logged with ``sync_dist=True`` keep a reference
            to its ``reduce``, which is resolved to each receiver's own strategy.
        src: global rank of the last stage, whose results are broadcast.
        group: the stages of the pipeline (``None``: every process, for a job of one pipeline).
        job: the run's :class:`~lightning_gpipe.faults.job.Job`, whose waits the broadcasts use.
    """

    def __init__(
        self, strategy: "pl.strategies.Strategy", src: int, group: Optional[dist.ProcessGroup], job: "Job"
    ) -> None:
        self.strategy, self.src, self.group, self.job = strategy, src, group, job

    def __call__(self, trainer: "pl.Trainer") -> None:
        """Broadcast the last stage's current ``trainer._results`` entries; a collective call on all ranks.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        results = trainer._results
        if results is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mine = dist.get_rank() == self.src
        sent = self._dumps(dict(results)) if mine else None
        payload = collectives.broadcast_object(self.job, sent, self.src, self.group)
        if not mine:
            results.clear()
            results.update(self._loads(payload))
            results.to(self.strategy.root_device)

    def relay_after_epoch_end_hooks(self, module: "pl.LightningModule") -> None:
        """Relay after each of the module's epoch-end hooks, which may log (e.g. ``metric.compute()``).

        They run before Lightning reads the epoch's metrics and before ``ModelCheckpoint`` and
        ``EarlyStopping`` act. The hooks are wrapped on the instance; undone by :meth:`unwrap_epoch_end_hooks`.
        """
        for name in EPOCH_END_HOOKS:
            setattr(module, name, _hook_then_relay(getattr(module, name), lambda: self(module.trainer)))

    @staticmethod
    def unwrap_epoch_end_hooks(module: "pl.LightningModule") -> None:
        """Remove the wrappers set by :meth:`relay_after_epoch_end_hooks`."""
        for name in EPOCH_END_HOOKS:
            module.__dict__.pop(name, None)

    def _dumps(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer)
        pickler.persistent_id = lambda o: "strategy" if o is self.strategy else None
        pickler.dump(obj)
        return buffer.getvalue()

    def _loads(self, data: bytes) -> Any:
        unpickler = pickle.Unpickler(io.BytesIO(data))
        unpickler.persistent_load = lambda pid: self.strategy
        return unpickler.load()


def share_step_output(output: Any, is_last: bool, share: Callable[[Any], Any], device: torch.device) -> Any:
    """The last stage's ``training_step`` output on every stage of the pipeline (a collective call).

    The last stage sends a detached CPU copy of its output (the loss, or the dict with its ``"loss"`` and any other
    entries) and returns its own; the other stages return the copy, its tensors on ``device``. Whatever the user's
    step returns travels once per step, so keep it small (the loss and a few scalars).

    Args:
        output: the user's output on the last stage (ignored on the others).
        is_last: whether this is the last stage.
        share: sends a picklable object from the last stage to every stage of the pipeline and returns it.
        device: where the other stages put the received tensors.

    Raises:
        PipelineFailure: if another stage failed while this one waited for it.
    """
    sent = apply_to_collection(output, Tensor, lambda tensor: tensor.detach().cpu()) if is_last else None
    received = share(sent)
    return output if is_last else apply_to_collection(received, Tensor, lambda tensor: tensor.to(device))


def _hook_then_relay(hook: Callable[[], None], relay: Callable[[], None]) -> Callable[[], None]:
    def hook_then_relay() -> None:
        hook()
        relay()

    return hook_then_relay
