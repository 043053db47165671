"""What activation offload (``offload="activations"``, :mod:`lightning_gpipe.engine.offload`) spares a process's device
memory and costs its step, predicted from its own plan and the engine's placement of the plan's offloads.

Memory: walking a process's actions, each model chunk holds on the device the saved activations of the micro-batches
between their forward (or recompute) and their backward (with the B/W split, their W). With offload, a micro-batch
the placement offloads (:func:`~lightning_gpipe.engine.offload.placement`) leaves the device once the next computing
action after its forward has run (its copy overlaps that action) and is back from its prefetch (before the action
that precedes its backward) on; a re-materialized micro-batch's forward saves nothing. The bytes spared are, per model
chunk, the peak count of micro-batches held without offload less that with it, times what one micro-batch's forward
saves and offload moves (:func:`offloaded_bytes`; the chunk's kept input and its last layer's output stay, as the
engine keeps them, and so do the gradients B keeps for W). The model chunks' peaks are taken as if they coincided,
and saved tensors under :data:`~lightning_gpipe.engine.offload.MIN_BYTES`, which stay, are counted as moved.

Time: each offloaded micro-batch is copied out over the action after its forward and back over the action before
its backward, on a side stream; what a copy (``CostModel.host_copy_time``) takes beyond the chunk's forward, the
shorter action it overlaps, is added to the step (:func:`exposed_seconds`), the largest over the processes: an upper
bound where the stages wait for each other anyway.
"""

from collections.abc import Sequence

from lightning_gpipe.engine import COMPUTE, Kind, Plan, checkpointed, offload_placement
from lightning_gpipe.planning.costs import CostModel


def offloaded_bytes(plan: Plan, checkpoint: str, micro_batches: int, moved: Sequence[int]) -> int:
    """Bytes of a process's peak of saved activations that offload keeps in host memory (see the module docstring).

    Args:
        plan: the process's plan.
        checkpoint: the re-materialization mode.
        micro_batches: M.
        moved: per model chunk, the bytes of one micro-batch's saved activations that offload moves.
    """
    without = _device_peaks(plan, checkpoint, micro_batches, False)
    held = _device_peaks(plan, checkpoint, micro_batches, True)
    return sum(max(a - b, 0) * nbytes for a, b, nbytes in zip(without, held, moved))


def exposed_seconds(
    plan: Plan, checkpoint: str, micro_batches: int, moved: Sequence[int], forward: Sequence[float], model: CostModel
) -> float:
    """Seconds a process's offload copies add to its step: for each offloaded micro-batch that saved anything, its
    copy out and its copy back, each beyond ``forward[c]`` seconds (its model chunk's forward, which it overlaps).

    Args:
        plan: the process's plan.
        checkpoint: the re-materialization mode.
        micro_batches: M.
        moved: per model chunk, the bytes one micro-batch's offload moves each way.
        forward: per model chunk, its forward's seconds on one micro-batch.
        model: the machine's constants (``host_bandwidth``).
    """
    offloaded = offload_placement(plan).offloaded
    return sum(
        2 * max(model.host_copy_time(moved[c]) - forward[c], 0.0)
        for c, i in offloaded
        if not checkpointed(checkpoint, i, micro_batches)
    )


def _device_peaks(plan: Plan, checkpoint: str, micro_batches: int, offload: bool) -> list[int]:
    """Per model chunk, the most micro-batches whose saved activations are on the device at once over ``plan``,
    with or without ``offload`` (see the module docstring)."""
    chunks = 1 + max(a.model_chunk for a in plan.actions)
    placed = offload_placement(plan) if offload else None
    weights = {(a.model_chunk, a.micro_batch) for a in plan.actions if a.kind is Kind.WEIGHT}
    level, peak = [0] * chunks, [0] * chunks
    leaving: list[tuple[int, int]] = []  # offloaded by the last forward: on the device until the next action ends
    for n, action in enumerate(plan.actions):
        for c, i in placed.prefetch.get(n, ()) if placed is not None else ():
            if (c, i) in leaving:  # still on the device, its copy out under way: it stays
                leaving.remove((c, i))
            else:
                level[c] += not checkpointed(checkpoint, i, micro_batches)
        if action.kind not in COMPUTE or action.micro_batch is None:
            continue
        c, i, kind = action.model_chunk, action.micro_batch, action.kind
        saves = kind is Kind.RECOMPUTE or (kind is Kind.FORWARD and not checkpointed(checkpoint, i, micro_batches))
        frees = kind is Kind.WEIGHT or (kind is Kind.BACKWARD and (c, i) not in weights)
        level[c] += saves - frees
        peak = [max(p, held) for p, held in zip(peak, level)]
        for chunk, _ in leaving:
            level[chunk] -= 1
        offloaded = placed is not None and kind is Kind.FORWARD and (c, i) in placed.offloaded
        leaving = [(c, i)] if offloaded and saves else []
    return peak
