"""GPipe pipeline parallelism as a PyTorch Lightning strategy.

Importing this package registers the strategy names ``"gpipe"`` and ``"gpipe_spawn"``
(Lightning 2.6 has no entry point for third-party strategies)::

    import lightning_gpipe
    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2)
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gpipe.faults.failure import PipelineFailure
from lightning_gpipe.lightning.agreement import BatchMismatchError
from lightning_gpipe.lightning.callbacks import (
    PipelineBalance,
    PipelineModelSummary,
    PipelineThroughput,
    PipelineTimeline,
)
from lightning_gpipe.lightning.contract import forward_and_share
from lightning_gpipe.lightning.planner import plan
from lightning_gpipe.lightning.strategy import GPipeStrategy
from lightning_gpipe.planning import CostModel, PlanReport
from lightning_gpipe.planning.balance import LayerCost, balance_by, profile_layers, solve

__all__ = [
    "BatchMismatchError",
    "CostModel",
    "GPipeStrategy",
    "LayerCost",
    "PipelineBalance",
    "PipelineFailure",
    "PipelineModelSummary",
    "PipelineThroughput",
    "PipelineTimeline",
    "PlanReport",
    "balance_by",
    "forward_and_share",
    "plan",
    "profile_layers",
    "solve",
]
__version__ = "0.1.0"

if "gpipe" not in StrategyRegistry:
    GPipeStrategy.register_strategies(StrategyRegistry)
