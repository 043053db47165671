"""Make what user code logs on the last stage known to every stage.

Only the last stage runs the part of a step after the backbone call, so only its
``self.log`` calls record values. Loggers write on global rank 0 (the first
stage), the progress bar shows there, and callbacks such as ``ModelCheckpoint``
and ``EarlyStopping`` read ``trainer.callback_metrics`` on every rank and must
decide alike. So after every step, and after the user's epoch-end hooks, the last
stage broadcasts its logged results to the other stages of its pipeline (Lightning's ``_ResultCollection`` entries,
with their accumulated epoch state) and every other stage takes them as its own.
"""

import io
import pickle
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_gpipe import collectives

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


class LogRelay:
    """Copies the last stage's logged results to every stage.

    Args:
        strategy: the running strategy; values logged with ``sync_dist=True`` keep a reference
            to its ``reduce``, which is resolved to each receiver's own strategy.
        src: global rank of the last stage, whose results are broadcast.
        group: the stages of the pipeline (``None``: every process, for a job of one pipeline).
    """

    def __init__(self, strategy: "pl.strategies.Strategy", src: int, group: Optional[dist.ProcessGroup] = None) -> None:
        self.strategy, self.src, self.group = strategy, src, group

    def __call__(self, trainer: "pl.Trainer") -> None:
        """Broadcast the last stage's current ``trainer._results`` entries; a collective call on all ranks.

        Raises:
            PipelineFailure: if another stage failed while this one waited for it.
        """
        results = trainer._results
        if results is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        mine = dist.get_rank() == self.src
        payload = collectives.broadcast_object(self._dumps(dict(results)) if mine else None, self.src, self.group)
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


def _hook_then_relay(hook: Callable[[], None], relay: Callable[[], None]) -> Callable[[], None]:
    def hook_then_relay() -> None:
        hook()
        relay()

    return hook_then_relay
