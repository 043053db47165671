"""Whole backwards or the B/W split: the default's choice, made from the profiled layers and the simulator.

Zero-bubble's split (Qi et al. 2023, section 2) runs each backward's input gradient (B) at once and its weight
gradient (W) where the stage would otherwise wait for the next gradient, so under fill-drain W fills the drain's
bubble. Each W is one more action per micro-batch, and W and B together cost more than one whole backward (W runs the
parameters' side of the autograd nodes again): where layers are small, that costs more than the bubble it fills.
:func:`choose_split` predicts both with the simulator (:func:`~lightning_gpipe.planning.simulator.simulate`) on the
layers' measured B and W times (:class:`~lightning_gpipe.planning.balance.costs.LayerCost`) and keeps the split only
where it is predicted faster by at least :data:`MIN_GAIN`. Either way the result is the same: the split is exact.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_gpipe.planning.balance.choose import layer_memory
from lightning_gpipe.planning.balance.costs import LayerCost
from lightning_gpipe.planning.balance.solver import stage_sums
from lightning_gpipe.planning.costs import CostModel
from lightning_gpipe.planning.predict import modelled_stage_costs
from lightning_gpipe.planning.simulator import Transfer, simulate

MIN_GAIN = 0.02
"""The predicted step-time gain below which whole backwards are kept (2%: within the simulator's error, the
simpler plan wins)."""


@dataclass(frozen=True)
class SplitChoice:
    """What :func:`choose_split` chose, and why.

    Args:
        split: ``True`` for the B/W split (``defer_weight_grad=True``), ``False`` for whole backwards.
        whole: the predicted seconds per step with whole backwards (0 when not predicted).
        divided: the predicted seconds per step with the split (0 when not predicted).
        reason: why, in a few words.
    """

    split: bool
    whole: float
    divided: float
    reason: str


def choose_split(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    micro_batches: int,
    checkpoint: str,
    virtual_stages: int = 1,
    model: CostModel = CostModel(),
    memory_limit: int | None = None,
) -> SplitChoice:
    """Whole backwards or the B/W split for fill-drain, whichever the simulator predicts faster.

    Args:
        costs: the backbone layers' profiled costs, with their B and W times (``input_grad``, ``weight_grad``;
            :func:`~lightning_gpipe.planning.balance.profile_layers` with ``split=True``), for one micro-batch.
        balance: layers per (virtual) stage.
        micro_batches: M.
        checkpoint: the re-materialization mode, as for ``GPipeStrategy``.
        virtual_stages: model chunks per process (default 1).
        model: the machine's constants (default: the package's).
        memory_limit: bytes one stage may hold for one micro-batch (its layers'
            activations and parameters); the split is kept only if each stage, with the gradients B keeps for W
            (``kept_grad_bytes``), stays within it. ``None`` (default): no limit.
    """
    if not any(cost.input_grad or cost.weight_grad for cost in costs):
        return SplitChoice(False, 0.0, 0.0, "the layers' B and W times were not measured")
    whole, divided = (
        _step_time(costs, balance, micro_batches, checkpoint, virtual_stages, model, s) for s in (False, True)
    )
    gain = whole / divided
    times = f"predicted {divided * 1e3:.4g} ms per step with the split, {whole * 1e3:.4g} ms without ({gain:.2f}x)"
    if gain < 1 + MIN_GAIN:
        return SplitChoice(False, whole, divided, f"{times}, not the {1 + MIN_GAIN:.2f}x a split must gain")
    if memory_limit is not None:
        held = stage_sums(layer_memory(costs), balance)
        kept = stage_sums([cost.kept_grad_bytes for cost in costs], balance)
        if any(h + k > memory_limit for h, k in zip(held, kept)):
            exceed = f"but B's kept gradients exceed the memory limit of {memory_limit:,} bytes"
            return SplitChoice(False, whole, divided, f"{times}, {exceed}")
    return SplitChoice(True, whole, divided, times)


def _step_time(
    costs: Sequence[LayerCost],
    balance: Sequence[int],
    micro_batches: int,
    checkpoint: str,
    virtual_stages: int,
    model: CostModel,
    split: bool,
) -> float:
    """The simulated fill-drain step, in seconds, with whole backwards or (``split``) the B/W split."""
    stages = modelled_stage_costs(costs, balance, model, split=split)
    transfer = Transfer(model.transfer_latency, model.transfer_bandwidth)
    simulated = simulate(
        stages, micro_batches, checkpoint, transfer, defer_weight_grad=split, virtual_stages=virtual_stages
    )
    return simulated.step_time + model.step_overhead
