"""The Lightning adapter: :class:`~lightning_gpipe.lightning.strategy.GPipeStrategy` and what it wires together.

The strategy's hooks (:mod:`~lightning_gpipe.lightning.strategy`, over the mesh of processes in
:mod:`~lightning_gpipe.lightning.mesh`), its options (:mod:`~lightning_gpipe.lightning.config`), the builder of a
process's stage (:mod:`~lightning_gpipe.lightning.build`) and its run (:mod:`~lightning_gpipe.lightning.step`), the
logging relay, checkpoints, the optimizer step, batch agreement, signals, data, the callbacks and the planner's
entry point. With :mod:`lightning_gpipe.hf`, the only part of the package that imports Lightning.

Its front door is this package: the names below are everything the layers above (the Hugging Face adapter, the
top-level package) use of the adapter; its modules are its internals.
"""

from lightning_gpipe.lightning._lightning import attached_trainer
from lightning_gpipe.lightning.agreement import BatchMismatchError
from lightning_gpipe.lightning.callbacks import (
    PipelineBalance,
    PipelineModelSummary,
    PipelineThroughput,
    PipelineTimeline,
)
from lightning_gpipe.lightning.contract import forward_and_share
from lightning_gpipe.lightning.data_parallel import whole_tensors
from lightning_gpipe.lightning.planner import plan
from lightning_gpipe.lightning.state_dict import DamagedCheckpointError
from lightning_gpipe.lightning.strategy import GPipeStrategy

__all__ = [
    # the strategy, the backbone call that shares a last-stage value, planning without training
    "GPipeStrategy",
    "forward_and_share",
    "plan",
    # what a run or a checkpoint's load raises besides the job's failures
    "BatchMismatchError",
    "DamagedCheckpointError",
    # the callbacks
    "PipelineBalance",
    "PipelineModelSummary",
    "PipelineThroughput",
    "PipelineTimeline",
    # for a LightningModule of the pipeline: its trainer, if any, and a sharded stage's state gathered whole
    "attached_trainer",
    "whole_tensors",
]
