"""Planning the pipeline for the user: mesh, ``chunks``, ``checkpoint``, ``schedule`` and ``balance`` under a memory
limit, from a profile of the backbone and the simulator (see docs/planning.md).

:func:`lightning_gpipe.plan` plans without training; ``GPipeStrategy(plan="auto", memory_limit=...)`` plans at setup.
Both return a :class:`PlanReport`: the chosen :class:`PipelinePlan`, its predicted step time, bubble and per-stage
memory (:class:`StageMemory`), and the runners-up. :class:`CostModel` holds the machine's constants.
"""

from lightning_gpipe.planning.costs import CostModel, ProfiledCosts, optimizer_state_factor
from lightning_gpipe.planning.predict import PipelinePlan, PlanPrediction, StageMemory, predict
from lightning_gpipe.planning.report import PlanReport
from lightning_gpipe.planning.search import Constraints, search

__all__ = [
    "Constraints",
    "CostModel",
    "PipelinePlan",
    "PlanPrediction",
    "PlanReport",
    "ProfiledCosts",
    "StageMemory",
    "optimizer_state_factor",
    "predict",
    "search",
]
