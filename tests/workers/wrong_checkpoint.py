"""Distributed worker: checkpoints that do not fit the model, or are damaged, resumed on 2 stages.

Usage: python wrong_checkpoint.py OUT_DIR
The model is a ``Stack`` of 3 linear backbone layers of width 8. One step of a stack of 5 layers ("deeper"), of 2
("shallower"), of 3 of width 12 ("wider") and of the model itself ("same") writes a sharded checkpoint
OUT_DIR/{name}_sharded.ckpt, which global rank 0 consolidates to the full file OUT_DIR/{name}.ckpt. Then, one after the
other on the same processes:

- ``resume_{name}_{layout}`` (layout "full" or "sharded"): the model resumes training from the deeper, shallower
  and wider checkpoint in each layout; each must fail.
- ``lenient_{name}_{layout}``: a model with ``strict_loading=False`` validates with the deeper and the shallower
  checkpoint, full and sharded; global rank 0 writes its module's state afterwards to OUT_DIR/{case}.pt.
- ``truncated_file``, ``truncated_shard``: the model resumes from a copy of "same"'s checkpoint cut to half its size
  (OUT_DIR/truncated.ckpt), and from a copy of its directory whose shard ``__1_0.distcp`` is cut to half
  (OUT_DIR/truncated_sharded.ckpt); each must fail.

Global rank 0 writes OUT_DIR/plain.json: per checkpoint, what loading its weights into the model says without a
pipeline. Each rank writes OUT_DIR/cases_rank{r}.json: per case, ``"error"`` (``"Type: message"`` of the exception
the fit raised, or ``"no error"``) and ``"batches"`` (the training batches it started), and OUT_DIR/rank{r}.txt, its
pid.
"""

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from models import CLASSES, FEATURES, loader, trainer_kwargs  # noqa: E402
from torch import nn  # noqa: E402

import lightning_gpipe  # noqa: E402
from lightning_gpipe.lightning.consolidate import consolidate  # noqa: E402

OUT = sys.argv[1]
rank = int(os.environ.get("LOCAL_RANK", "0"))
with open(os.path.join(OUT, f"rank{rank}.txt"), "w") as f:
    f.write(str(os.getpid()))

SHAPES = {"same": (3, 8), "deeper": (5, 8), "shallower": (2, 8), "wider": (3, 12)}
"""Each checkpoint's model: backbone layers and width."""


class Stack(L.LightningModule):
    """``depth`` linear layers of ``width`` features as the backbone, then a linear head."""

    def __init__(self, depth: int = 3, width: int = 8, strict_loading: bool = True) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*[nn.Linear(FEATURES if i == 0 else width, width) for i in range(depth)])
        self.head = nn.Linear(width, CLASSES)
        self.strict_loading = strict_loading

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Batches(L.Callback):
    """Counts the training batches started."""

    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *_) -> None:
        self.started += 1


def trainer(max_steps: int, state_dict_type: str = "full", callbacks=(), **overrides) -> L.Trainer:
    strategy = lightning_gpipe.GPipeStrategy(chunks=2, state_dict_type=state_dict_type)
    kwargs = trainer_kwargs(callbacks=list(callbacks), **overrides)
    return L.Trainer(strategy=strategy, devices=2, max_steps=max_steps, **kwargs)


def path(name: str) -> str:
    return os.path.join(OUT, name)


def checkpoint(name: str, layout: str) -> str:
    """The path of checkpoint ``name`` in ``layout`` ("full": a file; "sharded": a directory)."""
    return path(f"{name}.ckpt" if layout == "full" else f"{name}_sharded.ckpt")


def write_checkpoints() -> None:
    for name, (depth, width) in SHAPES.items():
        L.seed_everything(1, verbose=False)
        save = ModelCheckpoint(dirpath=OUT, filename=f"{name}_sharded", every_n_train_steps=1)
        run = trainer(max_steps=1, state_dict_type="sharded", callbacks=[save], enable_checkpointing=True)
        run.fit(Stack(depth, width), loader())
    if rank == 0:
        try:
            for name in SHAPES:
                consolidate(checkpoint(name, "sharded"), checkpoint(name, "full"))
            damage()
            without_pipeline()
        finally:
            dist.barrier()  # reached even if this failed, so that the cases fail on every stage instead of hanging
    else:
        dist.barrier()


def damage() -> None:
    """Write OUT_DIR/truncated.ckpt and OUT_DIR/truncated_sharded.ckpt: "same"'s checkpoints, cut to half."""
    shutil.copy(checkpoint("same", "full"), checkpoint("truncated", "full"))
    shutil.copytree(checkpoint("same", "sharded"), checkpoint("truncated", "sharded"))
    for cut in (checkpoint("truncated", "full"), os.path.join(checkpoint("truncated", "sharded"), "__1_0.distcp")):
        os.truncate(cut, os.path.getsize(cut) // 2)


def without_pipeline() -> None:
    """Write OUT_DIR/plain.json: what the model without a pipeline says when it loads each checkpoint's weights, as
    Lightning loads them (``LightningModule.load_state_dict`` with ``strict=True``)."""
    said = {}
    for name in SHAPES:
        try:
            Stack().load_state_dict(torch.load(checkpoint(name, "full"), weights_only=False)["state_dict"])
            said[name] = "no error"
        except RuntimeError as error:
            said[name] = f"{type(error).__name__}: {error}"
    with open(path("plain.json"), "w") as f:
        json.dump(said, f)


def resume(case: str, checkpoint_path: str, batches: Batches) -> None:
    trainer(max_steps=3, callbacks=[batches]).fit(Stack(), loader(), ckpt_path=checkpoint_path)


def lenient(case: str, checkpoint_path: str, batches: Batches) -> None:
    module = Stack(strict_loading=False)
    run = trainer(max_steps=1, callbacks=[batches])
    run.validate(module, loader(seed=1), ckpt_path=checkpoint_path, verbose=False)
    if rank == 0:
        torch.save(module.state_dict(), path(f"{case}.pt"))


LAYOUTS = ("full", "sharded")
CASES = {
    **{f"resume_{name}_{layout}": (resume, checkpoint(name, layout))
       for name in ("deeper", "shallower", "wider") for layout in LAYOUTS},
    **{f"lenient_{name}_{layout}": (lenient, checkpoint(name, layout))
       for name in ("deeper", "shallower") for layout in LAYOUTS},
    "truncated_file": (resume, checkpoint("truncated", "full")),
    "truncated_shard": (resume, checkpoint("truncated", "sharded")),
}  # fmt: skip
"""Each case: what runs, and the checkpoint it loads."""


write_checkpoints()
results = {}
for case, (run, loaded) in CASES.items():
    L.seed_everything(2, verbose=False)
    batches = Batches()
    try:
        run(case, loaded, batches)
        error = "no error"
    except Exception as raised:  # noqa: BLE001 - the message is what the test checks
        error = f"{type(raised).__name__}: {raised}"
    results[case] = {"error": error, "batches": batches.started}
with open(path(f"cases_rank{rank}.json"), "w") as f:
    json.dump(results, f)
