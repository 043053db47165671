"""Distributed worker: GPipeStrategy(schedule="1f1b") on 2 stages, many configurations in one launch (and two of
schedule="zb-h1", which runs the user's step like 1F1B).

Usage: python one_f_one_b.py OUT_DIR --devices 2
Writes rank 0's module state after each fit to OUT_DIR/<name>.pt for every entry of ``configs()`` (see the
test, tests/distributed/test_one_f_one_b.py, for what each is compared with); OUT_DIR/<name>_rank{r}.json per rank
for the 16-mixed runs (the gradient scaler's final scale) and the logging run (``WatchedNet.seen``), and
OUT_DIR/offload_rank{r}.json (the bytes each ``offload="activations"`` run moved to host memory on rank r); a full
checkpoint at step 3 resumed to step 6 (OUT_DIR/resume.pt); the error of a batch that cannot be split by rows
(OUT_DIR/unsplittable_rank{r}.txt). K = 3 and 4 run in tests/workers/equivalence.py.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from models import TupleNet  # noqa: E402
from rowwise import WatchedNet, fit_batches  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.engine import offload  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()
rank = int(os.environ.get("LOCAL_RANK", "0"))


def configs() -> dict[str, tuple[int, str, dict]]:
    """name -> (chunks, checkpoint, fit_batches overrides)."""
    # M < K; uneven micro-batches (20 rows: 7, 7, 6); M >= K, uneven (20 rows: 3 x 4 + 2 x 4; 12 rows: 2 x 4 + 1 x 4)
    return {
        "M1_always": (1, "always", {}),
        "M3_except_last": (3, "except_last", {}),
        "M8_never": (8, "never", {}),
        "clip_norm": (3, "except_last", dict(gradient_clip_val=0.05)),
        "accumulate": (3, "never", dict(accumulate_grad_batches=2)),
        "fp16": (3, "except_last", dict(plugins=[fp16(2.0**16)])),  # trains
        "fp16_overflow": (3, "except_last", dict(plugins=[fp16(2.0**24)])),  # every step overflows and is skipped
        "watched": (3, "except_last", dict(module=WatchedNet)),
        "deferred_weights": (3, "always", {}),  # with defer_weight_grad=True (see below)
        "zb_h1_M8_never": (8, "never", {}),  # schedule="zb-h1" (see below)
        "zb_h1_M3_always": (3, "always", {}),
        "offload_M8_never": (8, "never", {}),  # offload="activations" (see below)
        "offload_M3_except_last": (3, "except_last", {}),
        "offload_gpipe_M8_never": (8, "never", {}),
        "offload_zb_h1_M8_never": (8, "never", {}),
    }


OPTIONS = {
    "deferred_weights": dict(defer_weight_grad=True),
    "zb_h1_M8_never": dict(schedule="zb-h1"),
    "zb_h1_M3_always": dict(schedule="zb-h1"),
    "offload_M8_never": dict(offload="activations"),
    "offload_M3_except_last": dict(offload="activations"),
    "offload_gpipe_M8_never": dict(offload="activations", schedule="gpipe"),
    "offload_zb_h1_M8_never": dict(offload="activations", schedule="zb-h1"),
}
"""The strategy options of the configurations that differ from 1F1B's defaults."""


def fp16(scale: float) -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))


def strategy(chunks: int, checkpoint: str = "except_last", **kwargs) -> lightning_gpipe.GPipeStrategy:
    return lightning_gpipe.GPipeStrategy(**{"chunks": chunks, "checkpoint": checkpoint, "schedule": "1f1b", **kwargs})


def save(name: str, trainer) -> None:
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(args.out, f"{name}.pt"))


def write(name: str, facts) -> None:
    with open(os.path.join(args.out, f"{name}_rank{rank}.json"), "w") as f:
        json.dump(facts, f)


offload.MIN_BYTES = 0  # the tiny model's activations are all under the default
MOVED: dict[str, int] = {}  # bytes offloaded by each configuration on this rank
moving = offload.ActivationOffload._to_host


def counted(self, saved) -> bool:
    size, moved = saved.device.nbytes, moving(self, saved)
    MOVED[current] = MOVED.get(current, 0) + (size if moved else 0)
    return moved


offload.ActivationOffload._to_host = counted

for name, (chunks, checkpoint, overrides) in configs().items():
    current = name
    trainer = fit_batches(strategy(chunks, checkpoint, **OPTIONS.get(name, {})), args.devices, **overrides)
    save(name, trainer)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None:
        write(name, {"scale": scaler.get_scale()})
    if isinstance(trainer.lightning_module, WatchedNet):
        write(name, trainer.lightning_module.seen)
write("offload", MOVED)

every_3 = ModelCheckpoint(dirpath=args.out, filename="full", every_n_train_steps=3, save_top_k=-1)
fit_batches(strategy(3), args.devices, max_steps=3, enable_checkpointing=True, callbacks=[every_3])
save("resume", fit_batches(strategy(3), args.devices, ckpt_path=os.path.join(args.out, "full.ckpt")))


class Unsplittable(TupleNet):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return (*batch, torch.zeros(3))  # a per-batch constant, without rows

    def _loss(self, batch):
        return super()._loss(batch[:2])


try:
    fit_batches(strategy(3), args.devices, module=Unsplittable)
except ValueError as error:
    with open(os.path.join(args.out, f"unsplittable_rank{rank}.txt"), "w") as f:
        f.write(str(error))
