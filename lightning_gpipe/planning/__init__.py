"""Planning the pipeline for the user: mesh, ``chunks``, ``checkpoint``, ``schedule`` and ``balance`` under a memory
limit, from a profile of the backbone and the simulator (see docs/planning.md).

:func:`lightning_gpipe.plan` plans without training; ``GPipeStrategy(plan="auto", memory_limit=...)`` plans at setup.
Both return a :class:`PlanReport`: the chosen :class:`PipelinePlan`, its predicted step time, bubble and per-stage
memory (:class:`StageMemory`), and the runners-up. :class:`CostModel` holds the machine's constants.

Its front door is this package: the names below are its public API (planning, above) and everything the layers
above (the Lightning adapter, the top-level package) use of it: profiling a backbone, choosing ``balance`` and the
B/W split, the simulator's stage costs. Its modules are its internals (:mod:`~lightning_gpipe.planning.balance` and
:mod:`~lightning_gpipe.planning.simulator` have API pages of their own).
"""

from lightning_gpipe.planning.balance import (
    MODES,
    LayerCost,
    balance_by,
    layer_memory,
    profile_layers,
    resolve_balance,
    solve,
    solve_by_stage,
)
from lightning_gpipe.planning.costs import CostModel, ProfiledCosts, optimizer_state_factor
from lightning_gpipe.planning.predict import (
    PipelinePlan,
    PlanPrediction,
    StageMemory,
    modelled_stage_costs,
    predict,
    state_copies,
)
from lightning_gpipe.planning.profiling import AfterBackbone, measure_host_bandwidth, module_state_factor, profile_sizes
from lightning_gpipe.planning.report import PlanReport
from lightning_gpipe.planning.search import Constraints, search
from lightning_gpipe.planning.simulator import StageCost, action_costs, simulate, stage_costs
from lightning_gpipe.planning.split import SplitChoice, choose_split
from lightning_gpipe.planning.tensor import LayerSplit, layer_split, matching_modules, per_tensor_rank

__all__ = [
    # planning: the search and its report, the machine's constants, what a plan is predicted to cost
    "Constraints",
    "CostModel",
    "PipelinePlan",
    "PlanPrediction",
    "PlanReport",
    "StageMemory",
    "measure_host_bandwidth",
    "predict",
    "search",
    # the profile of a backbone and what runs after it; the optimizer's state
    "AfterBackbone",
    "LayerCost",
    "ProfiledCosts",
    "module_state_factor",
    "optimizer_state_factor",
    "state_copies",
    "profile_layers",
    "profile_sizes",
    # balance and the B/W split
    "MODES",
    "SplitChoice",
    "balance_by",
    "choose_split",
    "layer_memory",
    "resolve_balance",
    "solve",
    "solve_by_stage",
    # tensor parallelism: how the split leaves each layer, and one tensor rank's costs
    "LayerSplit",
    "layer_split",
    "matching_modules",
    "per_tensor_rank",
    # the simulator's costs of a stage's actions and its step
    "StageCost",
    "action_costs",
    "modelled_stage_costs",
    "simulate",
    "stage_costs",
]
