"""The plans' rules exist once (:mod:`lightning_gpipe.engine.clock`): every reader of plans gives what it gave before.

``tests/data/plan_digests.json`` holds, for every case below, a digest of what the four readers of plans gave at
commit e3c7a5b, before they shared the clock (each had its own copy of the rule "a forward waits for the previous
virtual stage's output, a backward for the next one's gradient"): every stage's plan (ZB-V's order and the
placement of weight gradients by cost included) and the evaluation plans, both passing :func:`check`, and the
simulator's step time, bubble, peaks and every span (kind, micro-batch, start, end, model chunk, bytes), with a
transfer latency and bandwidth, a loss and an optimizer step. A case that differs names itself. Changed on purpose
once since: the 1F1B-ordered plans (``"1f1b"``, ``"zb-h1"``, ``"zb-1p"``) lost the flush before each steady-phase
send (their 1266 cases were re-digested; the 720 fill-drain and 360 ZB-V cases, and the 174 1F1B-ordered ones
with no steady phase, kept theirs). The suite compares a third of the cases, drawn with a fixed seed (about 10 s on two
cores), and every one with the whole grid (tests/grid.py).
"""

import hashlib
import json
import random
from pathlib import Path

from grid import FULL

from lightning_gpipe.engine.schedule import check, evaluation, format_plans, plans
from lightning_gpipe.planning.simulator import StageCost, Transfer, action_costs, simulate

DIGESTS = Path(__file__).parents[1] / "data" / "plan_digests.json"
MODES = ("always", "except_last", "never")
VARIANTS = [  # (schedule, virtual stages, deferred W, costs drawn at random rather than equal)
    ("gpipe", 1, False, False), ("gpipe", 1, True, True), ("gpipe", 2, False, False), ("gpipe", 2, True, True),
    ("1f1b", 1, False, False), ("1f1b", 1, True, True), ("1f1b", 2, False, True),
    ("zb-h1", 1, True, False), ("zb-h1", 2, True, True),
    ("zb-1p", 1, True, False), ("zb-1p", 1, True, True), ("zb-1p", 2, True, True),
    ("zb-v", 2, True, False), ("zb-v", 2, True, True),
]  # fmt: skip


def _stage_costs(key: str, count: int, defer: bool, drawn: bool) -> list[StageCost]:
    if not drawn:
        return [
            StageCost(1.0, 2.0, weight=1.0 if defer else 0.0, input_bytes=1, activation_bytes=10, output_bytes=1)
        ] * count
    rng = random.Random(key)
    stages = []
    for _ in range(count):
        forward, backward = rng.uniform(0.5, 2), rng.uniform(1, 3)
        nbytes = (rng.randrange(1, 100), rng.randrange(1, 1000), rng.randrange(1, 100))
        stages.append(StageCost(forward, backward, None, *nbytes, weight=rng.uniform(0.2, 0.8) * backward))
    return stages


def _digest(schedule: str, k: int, m: int, mode: str, v: int, defer: bool, drawn: bool) -> tuple[str, str]:
    key = f"{schedule}/{k}/{m}/{mode}/v{v}/{'defer' if defer else 'whole'}/{'costed' if drawn else 'equal'}"
    stages = _stage_costs(key, k * v, defer, drawn)
    predicted = simulate(stages, m, mode, Transfer(0.01, 1000.0), 0.3, 0.1, schedule, defer, v)
    every = plans(schedule, k, m, mode, defer, v, action_costs(stages, 0.3 / m) if drawn else None)
    check(every)
    forwards = evaluation(k, m, v, schedule == "zb-v")
    check(forwards, training=False)
    spans = [
        (s.kind, s.micro_batch, round(s.start, 9), round(s.end, 9), s.model_chunk, s.input_bytes, s.saved_bytes)
        for stage in predicted.trace.stages
        for s in stage.spans
    ]
    summary = (round(predicted.step_time, 9), round(predicted.bubble, 9), predicted.peak_activation_bytes, spans)
    text = "\n".join([format_plans(every), format_plans(forwards), *map(repr, summary)])
    return key, hashlib.sha256(text.encode()).hexdigest()[:16]


def test_every_reader_of_plans_gives_what_it_gave_before_the_clock_was_shared():
    expected = json.loads(DIGESTS.read_text())
    cases = [
        (schedule, k, m, mode, v, defer, drawn)
        for schedule, v, defer, drawn in VARIANTS
        for k in range(2, 7)
        for m in range(1, 13)
        for mode in MODES
    ]
    assert len(cases) == len(expected) == 2520
    found = dict(_digest(*case) for case in (cases if FULL else random.Random(0).sample(cases, len(cases) // 3)))
    assert [key for key, value in found.items() if expected[key] != value] == []
