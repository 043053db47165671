"""Tensor parallelism inside each stage: each process's state at pp=2 x tp=2 against pp=2 alone, the row-parallel
layers' all-reduces per step against their count from the schedule, and (``--check-3d``) pp=2 x dp=2 x tp=2 with FSDP2
against one device.

**State and collectives** (the default). An MLP of ``blocks`` Megatron-LM blocks, ``Linear(w, 4w) -> ReLU ->
Linear(4w, w)`` (w = ``--width``; 6 blocks of w = 1024: 50.4M parameters), and a ``Linear(w, 10)`` head, trained with
AdamW for ``--steps`` steps, in two fresh launches (Lightning's launcher, gloo, one CPU thread per process):

- ``pp2``: ``GPipeStrategy(pipeline_parallel_size=2)``, 2 processes, each holding its stage whole;
- ``pp2_tp2``: ``GPipeStrategy(pipeline_parallel_size=2, tensor_parallel_size=2)``, 4 processes; the module's
  ``configure_model`` (tests/tensor_parallel.py's ``SplitMLP``) splits each block its stage holds over the stage's 2
  tensor ranks, the first Linear by output columns and the second by input rows (``ColwiseParallel``,
  ``RowwiseParallel``): each rank holds half of both weights and of the first bias; the second bias and the head
  stay whole on every tensor rank.

Every process measures at the last step's ``on_before_optimizer_step`` (benchmarks/_held.py): its parameters' bytes
(a ``DTensor``'s local shard) and its gradients' and AdamW's two states' bytes, and in the last step the calls of
``torch.distributed._functional_collectives.all_reduce``. That function is what a ``DTensor`` calls to sum a
``Partial`` placement over the tensor ranks (``Partial._reduce_value``, looked up in the module when it is called, on
whatever thread: the forward's and the backward's alike), on torch 2.13; ``dist.all_reduce`` never sees them (the
functional op calls the process group from C++), and a ``TorchDispatchMode`` counting ``_c10d_functional.all_reduce``
counts the same on one thread only. Expected per step, for a stage holding b blocks with M micro-batches of which R
recompute their forward in the backward (``checkpoint="except_last"``, the default: R = M - 1; ``"always"``: M;
``"never"``: 0):

- forward, b per micro-batch: a row-parallel Linear's products are partial sums, summed over the tensor ranks at its
  output (the block's one forward all-reduce: Megatron-LM's g); (M + R) b with the recomputed forwards;
- backward, b per micro-batch: a column-parallel Linear's input gradient is a partial sum (each rank's columns'
  part), summed at its input (Megatron-LM's f); on the first stage b - 1, as the first block's input, the batch,
  takes no gradient.

So (M + R) b + M b on the last stage and (M + R) b + M (b - 1) on the first: 2 per block per micro-batch without
re-materialization, as Megatron-LM counts it. The parameter bytes at pp=2 x tp=2 over pp=2's, per stage, must be at
most 0.55 (issue 56); they are 0.5 plus the whole biases' and head's share.

**``--check-3d``**: pp=2 x dp=2 x tp=2 with ``sharding_strategy="FULL_SHARD"`` (FSDP2 over each tensor-parallel
stage's 2 replicas), 8 CPU processes in one launch, ``schedule="gpipe"`` then ``"1f1b"``, global gradient clipping
(0.05), tests/tensor_parallel.py's ``SplitMLP`` (4 blocks of width 16) trained 6 AdamW steps on its global batches of
40 rows; each against the same module trained by single-device Lightning (fp32): the largest difference of any
parameter and of any step's loss, and PASS where every parameter is within the test suite's fp32 rounding rule
(tests/conftest.py, ``assert_within_fp32_rounding``: within 1e-5, or no farther from a float64 run than 4x the
one-device fp32 run's own distance to it, plus 1e-5) and every loss within 1e-5. Too heavy for the suite (8
processes on 2 cores), so it lives here.

Byte and call counts do not depend on the machine's load: each configuration runs once.

Usage::

    python benchmarks/tensor_parallel.py                 # 50.4M parameters, M=4, 3 steps
    python benchmarks/tensor_parallel.py --width 512 --blocks 4 --checkpoint never
    python benchmarks/tensor_parallel.py --check-3d
"""

import argparse
import functools
import os
import sys
import tempfile
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPOSITORY / "tests"), str(REPOSITORY)]  # the tests' SplitMLP; benchmarks.models

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from _harness import Config, emit, print_command, run_or_exit  # noqa: E402 - benchmarks/, the script's directory
from _held import Measure, count_calls  # noqa: E402
from conftest import assert_within_fp32_rounding  # noqa: E402 - tests/, on the path above
from models import LossRecorder, trainer_kwargs  # noqa: E402 - tests/models.py
from tensor_parallel import STEPS, SplitMLP, in_float64, one_device, replicas_loader  # noqa: E402 - tests/
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.models import NUM_CLASSES, mlp_batch  # noqa: E402
from lightning_gpipe import GPipeStrategy  # noqa: E402

MIB = 2**20
RECOMPUTED = {"except_last": lambda m: m - 1, "always": lambda m: m, "never": lambda m: 0}
"""Micro-batches whose forward is recomputed in the backward, of M, per ``checkpoint`` mode."""
CLIP = 0.05
"""``--check-3d``'s ``gradient_clip_val`` (the tests' clipped runs')."""
SCHEDULES = ("gpipe", "1f1b")
"""``--check-3d``'s schedules."""


class WideSplitMLP(SplitMLP):
    """tests/tensor_parallel.py's ``SplitMLP`` (its ``configure_model`` splits every block the stage holds over
    ``self.device_mesh["tensor_parallel"]`` where there is one, column then row; AdamW) at benchmark size: ``blocks``
    x (``Linear(width, 4 width)``, ReLU, ``Linear(4 width, width)``) and a ``Linear(width, 10)`` head.
    ``blocks_held``: the blocks of this process's stage, once training starts."""

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        layers = [
            nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width)) for _ in range(blocks)
        ]
        self.backbone = nn.Sequential(*layers)
        self.head = nn.Linear(width, NUM_CLASSES)

    def on_train_start(self) -> None:
        self.blocks_held = len(list(self.backbone.children()))


def fit_state(args: argparse.Namespace) -> None:
    """In each launched process: one fit of configuration ``args.fit`` (``pp2``, ``pp2_tp2``); emits what it held."""
    tensor = 2 if args.fit == "pp2_tp2" else 1
    count_calls(funcol, "all_reduce")
    strategy = GPipeStrategy(
        pipeline_parallel_size=2, tensor_parallel_size=tensor, chunks=args.chunks, checkpoint=args.checkpoint
    )
    measure = Measure()
    trainer = pl.Trainer(
        strategy=strategy, devices=2 * tensor, max_steps=args.steps, **trainer_kwargs(callbacks=[measure])
    )
    x, y = mlp_batch(args.batch_size * args.steps, args.width)
    pl.seed_everything(0, verbose=False)
    module = WideSplitMLP(args.width, args.blocks)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=args.batch_size))
    rank = trainer.global_rank
    emit(
        rank,
        stage=strategy.topology.stage_of(rank),
        tensor_rank=strategy.topology.tensor_rank_of(rank),
        blocks=module.blocks_held,
        parameters=measure.parameters,
        rest=measure.state - measure.parameters,
        all_reduces=measure.collectives["all_reduce"],
    )


def expected_all_reduces(run: str, record: dict, args: argparse.Namespace) -> int:
    """The row-parallel blocks' all-reduces per step of the process of ``record`` in ``run`` (see the module
    docstring; none without tensor parallelism)."""
    if run != "pp2_tp2":
        return 0
    blocks, chunks = record["blocks"], args.chunks
    return (chunks + RECOMPUTED[args.checkpoint](chunks)) * blocks + chunks * (blocks - (record["stage"] == 0))


def report_state(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    """Print each process's bytes and all-reduces as a Markdown table, then the verdicts."""
    parameters = args.blocks * (8 * args.width**2 + 5 * args.width) + (args.width + 1) * NUM_CLASSES
    print(
        f"\nMLP of {args.blocks} blocks Linear({args.width}, {4 * args.width}) -> ReLU -> Linear({4 * args.width},"
        f" {args.width}) and a Linear({args.width}, {NUM_CLASSES}) head: {parameters / 1e6:.1f}M parameters; AdamW;"
        f" M={args.chunks}, {args.batch_size} rows per step, checkpoint={args.checkpoint!r}\n"
    )
    print(
        "| run | rank (stage, tensor rank) | blocks | parameters, MiB | gradients + AdamW, MiB | parameters / pp=2's"
        " | all-reduces per step | expected |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    whole = {r["stage"]: r["parameters"] for r in runs["pp2"]}
    ratios, counted = [], []
    for name, records in runs.items():
        for r in records:
            ratio, expected = r["parameters"] / whole[r["stage"]], expected_all_reduces(name, r, args)
            ratios += [ratio] if name == "pp2_tp2" else []
            counted.append(r["all_reduces"] == expected)
            print(
                f"| `{name}` | {r['rank']} ({r['stage']}, {r['tensor_rank']}) | {r['blocks']} |"
                f" {r['parameters'] / MIB:.2f} | {r['rest'] / MIB:.2f} | {ratio:.4f} |"
                f" {r['all_reduces']} | {expected} |"
            )
    print(f"\nlargest parameters / pp=2's at pp=2 x tp=2: {max(ratios):.4f} (<= 0.55: {_verdict(max(ratios) <= 0.55)})")
    print(f"all-reduces per step as expected on every process: {_verdict(all(counted))}")


def _verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def fit_3d(out: str) -> None:
    """In each of the 8 launched processes: :data:`SCHEDULES` at pp=2 x dp=2 x tp=2 under ``FULL_SHARD`` with clipping;
    global rank 0 writes OUT/SCHEDULE.pt (the module's whole state after fit, the loss after every step)."""
    for schedule in SCHEDULES:
        strategy = GPipeStrategy(
            pipeline_parallel_size=2,
            data_parallel_size=2,
            tensor_parallel_size=2,
            chunks=4,
            schedule=schedule,
            sharding_strategy="FULL_SHARD",
        )
        pl.seed_everything(1, verbose=False)
        recorder = LossRecorder()
        trainer = pl.Trainer(
            strategy=strategy,
            devices=8,
            max_steps=STEPS,
            **trainer_kwargs(callbacks=[recorder], gradient_clip_val=CLIP),
        )
        trainer.fit(SplitMLP(), replicas_loader(2))
        if trainer.global_rank == 0:
            state = {k: v.detach().clone() for k, v in trainer.lightning_module.state_dict().items()}
            torch.save({"state": state, "losses": recorder.losses}, os.path.join(out, f"{schedule}.pt"))
            emit(0, schedule=schedule, steps=len(recorder.losses))


def check_3d() -> None:
    """The 8-process launch of :func:`fit_3d`, then each run against one device (see the module docstring)."""
    with tempfile.TemporaryDirectory() as out:
        config = Config("pp2_dp2_tp2", ["--fit-3d", out], script=os.path.abspath(__file__))
        outcome = run_or_exit(config)
        print(f"8 processes, {len(SCHEDULES)} fits of {STEPS} steps: {outcome.seconds:.0f} s\n")
        runs = {schedule: torch.load(os.path.join(out, f"{schedule}.pt")) for schedule in SCHEDULES}
    state, losses = one_device(gradient_clip_val=CLIP)
    exact = functools.cache(lambda: in_float64({"gradient_clip_val": CLIP}))
    print("| run | steps | largest parameter difference | largest loss difference | verdict |")
    print("| --- | ---: | ---: | ---: | --- |")
    for schedule, got in runs.items():
        differences = {k: (got["state"][k] - v).abs().max().item() for k, v in state.items()}
        worst = max(differences, key=lambda k: differences[k])
        loss = max(abs(a - b) for a, b in zip(got["losses"], losses))
        try:
            assert_within_fp32_rounding(got["state"], state, exact)
            verdict = "PASS" if loss <= 1e-5 and len(got["losses"]) == len(losses) == STEPS else "FAIL (losses)"
        except AssertionError as error:
            verdict = f"FAIL ({str(error).splitlines()[0]})"
        print(
            f"| pp=2 x dp=2 x tp=2, `FULL_SHARD`, `{schedule}`, clip {CLIP} | {len(got['losses'])} |"
            f" {differences[worst]:.2e} (`{worst}`) | {loss:.2e} | {verdict} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024, help="w: blocks Linear(w, 4w) -> Linear(4w, w) (1024)")
    parser.add_argument("--blocks", type=int, default=6, help="blocks of the backbone (default 6: 50.4M parameters)")
    parser.add_argument("--chunks", type=int, default=4, help="M, micro-batches per step (default 4)")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per step (default 32)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps; the last is measured (default 3)")
    parser.add_argument("--checkpoint", choices=sorted(RECOMPUTED), default="except_last", help="re-materialization")
    parser.add_argument("--check-3d", action="store_true", help="pp=2 x dp=2 x tp=2 (FULL_SHARD) against one device")
    parser.add_argument("--fit", choices=("pp2", "pp2_tp2"), help=argparse.SUPPRESS)  # in a launched process
    parser.add_argument("--fit-3d", metavar="OUT", help=argparse.SUPPRESS)  # in a launched process
    args = parser.parse_args()
    if args.fit:
        return fit_state(args)
    if args.fit_3d:
        return fit_3d(args.fit_3d)
    print_command(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo, one thread per process")
    if args.check_3d:
        return check_3d()
    configs = [
        Config(name, [*sys.argv[1:], "--fit", name], script=os.path.abspath(__file__)) for name in ("pp2", "pp2_tp2")
    ]
    report_state(args, {config.name: run_or_exit(config).records for config in configs})


if __name__ == "__main__":
    main()
