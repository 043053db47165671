"""The configurations tests/workers/equivalence.py trains on K stages and tests/distributed/test_equivalence.py
compares with one device: every one on 2 stages; on 3 and 4 (4 processes on two cores cost seconds a run) a cut that
meets each micro-batch count, re-materialization mode and schedule kind once, unless :data:`grid.FULL`."""

from grid import FULL

CHUNKS = (1, 3, 8)
MODES = ("always", "except_last", "never")


def whole(stages: int) -> bool:
    """Whether every configuration runs on ``stages`` stages."""
    return FULL or stages == 2


def fill_drain(stages: int) -> list[tuple[int, str]]:
    """``(chunks, checkpoint)`` of the fill-drain runs: every pair, or each count with one mode."""
    if whole(stages):
        return [(chunks, mode) for chunks in CHUNKS for mode in MODES]
    return list(zip(CHUNKS, MODES))


def per_microbatch(stages: int) -> list[tuple[str, str]]:
    """``(schedule, checkpoint)`` of the 1F1B and zero-bubble runs (4 micro-batches on the 1F1B runs' batches)."""
    if whole(stages):
        return [("1f1b", mode) for mode in MODES] + [("zb-h1", "always"), ("zb-h1", "never"), ("zb-1p", "except_last")]
    return [("1f1b", "except_last"), ("zb-h1", "never"), ("zb-1p", "always")]


def interleaved(stages: int) -> list[tuple[str, str]]:
    """``(schedule, checkpoint)`` of the runs with ``virtual_stages=2``."""
    if whole(stages):
        pairs = [("gpipe", "always"), ("gpipe", "never"), ("1f1b", "except_last"), ("1f1b", "never")]
        return pairs + [("zb-h1", "always"), ("zb-1p", "never"), ("zb-v", "always"), ("zb-v", "never")]
    return [("gpipe", "never"), ("1f1b", "except_last"), ("zb-1p", "never"), ("zb-v", "always")]


V_SCHEDULES = {"v-min": "always", "v-half": "except_last", "v-zb": "never"}
"""The V schedules, each with a re-materialization mode, run on 2 and 4 stages (8 micro-batches, 6 AdamW steps)."""
