"""Choosing ``balance``: how many consecutive backbone layers each stage holds.

:func:`profile_layers` measures each layer (time, activation and parameter memory; timed until :class:`Repeats`
finds the runs settled), and :func:`balance_by` or the plain :func:`solve` turns per-layer costs into the contiguous
split whose costliest stage is as cheap as possible (:func:`solve_by_stage` where a layer's cost depends on the stage
it lands on); :func:`resolve_balance` checks a user's ``balance`` or chooses one. See docs/balance.md.
"""

from lightning_gpipe.planning.balance.choose import MODES, balance_by, layer_memory, layer_weights, resolve_balance
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.profile import profile_layers
from lightning_gpipe.planning.balance.repeats import Repeats
from lightning_gpipe.planning.balance.solver import solve, solve_by_stage, stage_sums

__all__ = [
    "MODES",
    "LayerCost",
    "Repeats",
    "balance_by",
    "layer_memory",
    "layer_weights",
    "profile_layers",
    "resolve_balance",
    "solve",
    "solve_by_stage",
    "stage_sums",
]
