"""GPipe pipeline parallelism as a PyTorch Lightning strategy.

Importing this package registers the strategy names ``"gpipe"`` and ``"gpipe_spawn"``
(Lightning 2.6 has no entry point for third-party strategies)::

    import lightning_gpipe
    trainer = L.Trainer(strategy="gpipe", accelerator="cpu", devices=2)
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_gpipe.engine import export_schedule
from lightning_gpipe.faults import PipelineFailure
from lightning_gpipe.lightning import (
    BatchMismatchError,
    DamagedCheckpointError,
    GPipeStrategy,
    PipelineBalance,
    PipelineModelSummary,
    PipelineThroughput,
    PipelineTimeline,
    forward_and_share,
    plan,
)
from lightning_gpipe.planning import CostModel, LayerCost, PlanReport, balance_by, profile_layers, solve

__all__ = [
    "BatchMismatchError",
    "CostModel",
    "DamagedCheckpointError",
    "GPipeStrategy",
    "LayerCost",
    "PipelineBalance",
    "PipelineFailure",
    "PipelineModelSummary",
    "PipelineThroughput",
    "PipelineTimeline",
    "PlanReport",
    "balance_by",
    "export_schedule",
    "forward_and_share",
    "plan",
    "profile_layers",
    "solve",
]
__version__ = "0.2.0.dev0"

if "gpipe" not in StrategyRegistry:
    GPipeStrategy.register_strategies(StrategyRegistry)
