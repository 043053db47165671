"""What placing W by cost (``schedule="zb-1p"``) gains over ZB-H1's fixed delay, on the simulator's clock.

Draws random per-virtual-stage costs (F in [0.5, 2] s, B 0.8-1.5 times F, W 0.5-2 times F; K 2-4 stages, 1 or 2
virtual stages, M in {4, 8, 12}, every checkpoint mode, the last stage's loss 0 or M / 2 s), and for each draw
predicts the step of ``"zb-1p"`` placed by those costs and of ``"zb-h1"`` with :func:`lightning_gpipe.simulate`.
No process runs: this measures the placement, not the machine (``compare.py`` and ``breakdown.py`` run it).

Usage::

    python benchmarks/placement.py                 # 300 draws, seed 0
    python benchmarks/placement.py --draws 1000 --seed 1
"""

import argparse
import random
import statistics

from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES
from lightning_gpipe.planning.simulator import StageCost, simulate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=300, help="random cost draws (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return parser.parse_args(argv)


def draw(rng: random.Random) -> dict:
    """One random pipeline: the keyword arguments of :func:`~lightning_gpipe.simulate` but the schedule."""
    num_stages, virtual, count = rng.choice([2, 3, 4]), rng.choice([1, 1, 2]), rng.choice([4, 8, 12])
    stages = []
    for _ in range(num_stages * virtual):
        forward = rng.uniform(0.5, 2.0)
        weight = forward * rng.uniform(0.5, 2.0)
        stages.append(StageCost(forward, forward * rng.uniform(0.8, 1.5) + weight, weight=weight))
    mode, loss = rng.choice(CHECKPOINT_MODES), rng.choice([0.0, count / 2])
    return dict(stages=stages, micro_batches=count, checkpoint=mode, loss=loss, virtual_stages=virtual)


def main(argv: list[str] | None = None) -> None:
    """Print the distribution of ZB-1p's predicted step over ZB-H1's."""
    args = parse_args(argv)
    rng = random.Random(args.seed)
    ratios = []
    for _ in range(args.draws):
        pipeline = draw(rng)
        placed, fixed = (simulate(**pipeline, schedule=name).step_time for name in ("zb-1p", "zb-h1"))
        ratios.append(placed / fixed)
    faster = sum(ratio < 0.99 for ratio in ratios)
    print(f"{args.draws} random cost draws (seed {args.seed}): predicted step of zb-1p / zb-h1")
    print(f"  min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f}")
    print(f"  faster by at least 1% in {faster} of {args.draws}; slower in {sum(r > 1 + 1e-9 for r in ratios)}")


if __name__ == "__main__":
    main()
