"""Distributed worker: a step fails or stops on one stage; every process must exit, naming the cause.

Usage: python failure.py CASE OUT_DIR [--devices K] [--timeout S] [--stall S]
CASE:
"validation" (user code after the backbone raises on the last stage, in validation_step),
"before_backbone" (a head is called before the backbone),
"double" (training_step calls the backbone twice, as in the quickstart repro of issue 15),
"layer_dict", "layer_scalar" (the last stage's last layer returns a dict, a 0-d tensor),
"float_labels" (float labels for cross-entropy, on the last stage),
"stuck" (the last stage sleeps for an hour in training_step at step 2; it writes OUT_DIR/stuck when it
starts to, and stage 0 writes OUT_DIR/waiting once it waits for it after that, a wait that cannot end),
"sigterm" (a healthy run of 3000 slow steps, for a signal; OUT_DIR/training is written at step 2, and
OUT_DIR/stopped_rank{r} when Lightning's SIGTERMException stops rank r),
"oom" (a layer of the last stage fills its memory under an RLIMIT_DATA cap at step 2, until an allocation fails),
"bad_inputs" (every case of ``BAD_INPUTS`` in turn, each a fit that must fail before its first step on every stage
alike; each rank writes the messages to OUT_DIR/bad_inputs_rank{r}.json),
"kill_full", "kill_sharded" (a checkpoint is written at step 3 to OUT_DIR/good_{kind}.ckpt, then the process
writing the step-6 checkpoint over it is killed with SIGKILL in the middle of the write: global rank 0 for a
full checkpoint, the last stage for a sharded one; OUT_DIR/killed_{kind} marks the kill),
"resume" (resume from both checkpoints to step 6, writing rank 0's module state to OUT_DIR/resumed_{kind}.pt),
"requeue" (the run of "sigterm" as one task of a SLURM job with ``SLURMEnvironment(auto_requeue=True)`` and
``default_root_dir=OUT_DIR``: the test starts each stage itself, with SLURM's variables; OUT_DIR/stopped_rank{r} holds
the global step at which Lightning's SIGTERMException ended rank r),
"before_the_store" (global rank 0 stops before it creates the job's store, once rank 1 is about to wait for it:
rank 1 writes OUT_DIR/joining, rank 0 then writes OUT_DIR/paused and sleeps for an hour, for a test that kills it).
--timeout and --stall set GPipeStrategy(timeout=, stall_timeout=) in seconds.
Each process writes OUT_DIR/rank{r}.txt holding its pid, so that the test can check that none is left.
"""

import argparse
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.utilities.exceptions import SIGTERMException  # noqa: E402
from models import FEATURES, TupleNet, fit, fit_trainer, loader  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("case")
parser.add_argument("out")
parser.add_argument("--devices", type=int, default=2)
parser.add_argument("--timeout", type=float, default=None)
parser.add_argument("--stall", type=float, default=None)
args = parser.parse_args()
rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
with open(os.path.join(args.out, f"rank{rank}.txt"), "w") as f:
    f.write(str(os.getpid()))


class FailingValidation(TupleNet):
    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        raise ValueError("boom in validation")


class HeadFirst(TupleNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.backbone((self.head(x), x > 0)).sum()


class DoubleCall(TupleNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.backbone((x, x > -1.0))
        out = self.backbone((x, x > -1.0))
        return F.cross_entropy(self.head(out), y)


class Returns(nn.Module):
    """A layer returning ``fn(x)`` of the tensor it gets (a dict, a 0-d tensor: what a pipeline refuses)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class LayerReturnsDict(TupleNet):
    """The last stage's last layer returns a dict."""

    def __init__(self):
        super().__init__()
        self.backbone.append(Returns(lambda x: {"h": x}))


class LayerReturnsScalar(TupleNet):
    """The last stage's last layer returns a 0-d tensor."""

    def __init__(self):
        super().__init__()
        self.backbone.append(Returns(lambda x: x.sum()))


class FloatLabels(TupleNet):
    """Float labels for cross-entropy: torch's error on the last stage, after the backbone."""

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone((x, x > -1.0))), y.float())


class Stuck(TupleNet):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)  # only the last stage gets past the backbone call
        if self.trainer.global_step == 2:
            open(os.path.join(args.out, "stuck"), "w").close()
            time.sleep(3600)
        return loss


class Slow(TupleNet):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            open(os.path.join(args.out, "training"), "w").close()
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


class Hog(nn.Module):
    """At step 2, caps this process's memory a little above what it uses and fills it until an allocation fails."""

    armed = False

    def forward(self, value):
        if Hog.armed:
            with open("/proc/self/status") as status:
                used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))
            resource.setrlimit(resource.RLIMIT_DATA, (used + 256 * 2**20, resource.RLIM_INFINITY))
            held = []
            for size in (2**20, 2**14):  # 1 MiB blocks, then 16 KiB ones, so that hardly any memory is left
                try:
                    while True:
                        held.append(torch.ones(size, dtype=torch.uint8))
                except RuntimeError:
                    if size == 2**14:
                        raise
        return value


class OutOfMemory(TupleNet):
    def __init__(self):
        super().__init__()
        self.backbone.insert(len(self.backbone) - 1, Hog())

    def training_step(self, batch, batch_idx):
        Hog.armed = self.trainer.global_step == 2
        return super().training_step(batch, batch_idx)


class KillMidSave(Callback):
    """Arms the kill of this process at the write of the step-6 checkpoint (a callback runs before the checkpoint's)."""

    armed = False

    def on_train_batch_end(self, trainer, *_):
        KillMidSave.armed = trainer.global_step == 6

    @staticmethod
    def kill(kind: str) -> None:
        open(os.path.join(args.out, f"killed_{kind}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def kill_in_the_write(kind: str) -> None:
    """Kill the process writing the step-6 checkpoint halfway through its file(s)."""
    if kind == "full" and rank == 0:  # rank 0 writes the one file, through fsspec
        from fsspec.implementations.local import LocalFileOpener

        write = LocalFileOpener.write

        def half_then_kill(self, data, *rest):
            if not KillMidSave.armed:
                return write(self, data, *rest)
            write(self, data[: len(data) // 2])
            self.f.flush()
            KillMidSave.kill(kind)

        LocalFileOpener.write = half_then_kill
    if kind == "sharded" and rank == args.devices - 1:  # after its shard's data, before the checkpoint is complete
        fsync = os.fsync

        def kill_at_sync(fd):
            if KillMidSave.armed:
                KillMidSave.kill(kind)
            fsync(fd)

        os.fsync = kill_at_sync


class PausedBeforeTheStore(LightningEnvironment):
    """Global rank 0 stops before it creates the job's store (the strategy sets the world size right before it joins
    the process group), once rank 1 has got there too."""

    def set_world_size(self, size: int) -> None:
        super().set_world_size(size)
        joining, paused = (os.path.join(args.out, name) for name in ("joining", "paused"))
        if self.global_rank() > 0:
            open(joining, "w").close()
            return
        while not os.path.exists(joining):
            time.sleep(0.05)
        open(paused, "w").close()
        time.sleep(3600)


def strategy(**kwargs) -> lightning_gpipe.GPipeStrategy:
    if args.timeout is not None:
        kwargs["timeout"] = timedelta(seconds=args.timeout)
    if args.stall is not None:
        kwargs["stall_timeout"] = timedelta(seconds=args.stall)
    return lightning_gpipe.GPipeStrategy(chunks=3, **kwargs)


def checkpoints(kind: str) -> ModelCheckpoint:
    return ModelCheckpoint(
        dirpath=args.out, filename=f"good_{kind}", every_n_train_steps=3, save_top_k=-1, enable_version_counter=False
    )


# ----------------------------------------------------------------------------- bad inputs, caught before any step


class NoSequential(TupleNet):
    def __init__(self):
        super().__init__()
        self.backbone = nn.ModuleList(self.backbone)


class TwoSequentials(TupleNet):
    def __init__(self):
        super().__init__()
        self.other = nn.Sequential(nn.Linear(FEATURES, FEATURES))


class Manual(TupleNet):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class OneLayer(TupleNet):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(FEATURES, FEATURES))

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(FEATURES))

    def forward(self, x):
        return x * self.weight


class LazyWithoutReset(TupleNet):
    def __init__(self):
        L.LightningModule.__init__(self)
        self.lr, self.backbone = 0.1, None

    def configure_model(self):
        if self.backbone is None:
            self.backbone = nn.Sequential(NoReset(), NoReset())
            self.head = nn.Linear(FEATURES, 3)

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)


class UnfilledTable(nn.Module):
    """A layer whose ``reset_parameters()`` fills its weight but not the table it computes in ``__init__``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(FEATURES))
        self.register_buffer("table", torch.linspace(0.5, 1.5, FEATURES), persistent=False)

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * self.weight * self.table


class LazyUnfilledTable(LazyWithoutReset):
    def configure_model(self):
        if self.backbone is None:
            self.backbone = nn.Sequential(UnfilledTable(), UnfilledTable())
            self.head = nn.Linear(FEATURES, 3)


BAD_INPUTS = {
    "balance_sum": lambda: fit(strategy=strategy(balance=[1, 1]), devices=2),
    "balance_length": lambda: fit(strategy=strategy(balance=[3, 3, 2]), devices=2),
    "balance_empty_stage": lambda: fit(strategy=strategy(balance=[8, 0]), devices=2),
    "backbone_name": lambda: fit(strategy=strategy(backbone="trunk"), devices=2),
    "two_sequentials": lambda: fit(strategy=strategy(), devices=2, module=TwoSequentials()),
    "no_sequential": lambda: fit(strategy=strategy(), devices=2, module=NoSequential()),
    "more_devices_than_layers": lambda: fit(strategy=strategy(), devices=2, module=OneLayer()),
    "manual_optimization": lambda: fit(strategy=strategy(), devices=2, module=Manual()),
    "impossible_memory_limit": lambda: fit(strategy=strategy(balance="time", balance_memory_limit=1), devices=2),
    "meta_layer_without_reset": lambda: fit(strategy=strategy(), devices=2, module=LazyWithoutReset()),
    "meta_buffer_unfilled": lambda: fit(strategy=strategy(), devices=2, module=LazyUnfilledTable()),
    "training_batches_differ": lambda: L.Trainer(
        strategy=strategy(), devices=2, max_steps=2, logger=False, enable_checkpointing=False
    ).fit(TupleNet(), loader(batch_size=20 + 6 * rank)),
    "validation_batches_differ": lambda: L.Trainer(  # no sanity check: its first batch would differ already
        strategy=strategy(), devices=2, max_steps=3, logger=False, enable_checkpointing=False, num_sanity_val_steps=0
    ).fit(TupleNet(), loader(), loader(batch_size=20 + 6 * rank)),
    "datasets_differ": lambda: L.Trainer(  # each process draws its own rows, as an unseeded torch.randn would
        strategy=strategy(), devices=2, max_steps=2, logger=False, enable_checkpointing=False
    ).fit(TupleNet(), loader(seed=rank)),
    "validation_order_differs": lambda: L.Trainer(
        strategy=strategy(), devices=2, logger=False, enable_progress_bar=False
    ).validate(TupleNet(), ordered_by_rank()),
    "resume_from_a_plain_directory": lambda: fit(strategy=strategy(), devices=2, ckpt_path=args.out),
}


def ordered_by_rank() -> DataLoader:
    """:func:`loader`'s rows in an order of each process's own (a sampler seeded by the local rank)."""
    dataset = loader().dataset
    return DataLoader(dataset, 20, sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(rank)))


def bad_inputs() -> None:
    messages = {}
    for name, run in BAD_INPUTS.items():
        L.seed_everything(1, verbose=False)
        try:
            run()
            messages[name] = "no error"
        except Exception as error:  # noqa: BLE001 - the message is what the test checks
            messages[name] = f"{type(error).__name__}: {error}"
    with open(os.path.join(args.out, f"bad_inputs_rank{rank}.json"), "w") as f:
        json.dump(messages, f)


def announce_the_endless_wait() -> None:
    """Make stage 0 write OUT_DIR/waiting once it waits for stage 1 while stage 1 is stuck (OUT_DIR/stuck): a wait
    that cannot end, in which the test interrupts it."""
    import threading

    from lightning_gpipe.faults.watchdog import Position

    waiting, inside = Position.waiting, threading.Event()

    def announce() -> None:
        while not (inside.is_set() and os.path.exists(os.path.join(args.out, "stuck"))):
            time.sleep(0.05)
        open(os.path.join(args.out, "waiting"), "w").close()

    @contextmanager
    def announced(position: Position, peer: str) -> Iterator[None]:
        with waiting(position, peer):  # the position now says stage 0 waits for ``peer``
            if peer == "stage 1":
                inside.set()
            try:
                yield
            finally:
                inside.clear()

    Position.waiting = announced
    threading.Thread(target=announce, daemon=True).start()


# ----------------------------------------------------------------------------- the cases

L.seed_everything(1, verbose=False)  # as `fit` does before it creates a module itself
MODULES = {
    "validation": FailingValidation,
    "before_backbone": HeadFirst,
    "double": DoubleCall,
    "layer_dict": LayerReturnsDict,
    "layer_scalar": LayerReturnsScalar,
    "float_labels": FloatLabels,
    "stuck": Stuck,
    "oom": OutOfMemory,
}
if args.case == "sigterm":
    try:
        fit(strategy=strategy(), devices=args.devices, module=Slow(), max_steps=3000)
    except SIGTERMException:
        open(os.path.join(args.out, f"stopped_rank{rank}"), "w").close()
        raise
elif args.case == "requeue":
    from lightning.fabric.plugins.environments import SLURMEnvironment

    module = Slow()
    try:
        fit(
            strategy=strategy(), devices=args.devices, module=module, max_steps=3000,
            plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=args.out,
        )  # fmt: skip
    except SIGTERMException:
        with open(os.path.join(args.out, f"stopped_rank{rank}"), "w") as f:
            f.write(str(module.trainer.global_step))
        raise
elif args.case in MODULES:
    if args.case == "stuck" and rank == 0:
        announce_the_endless_wait()
    fit(
        strategy=strategy(balance=[4, 5] if args.case == "oom" else None),
        devices=args.devices,
        module=MODULES[args.case](),
    )
elif args.case == "bad_inputs":
    bad_inputs()
elif args.case == "before_the_store":
    fit(strategy=strategy(), devices=args.devices, plugins=[PausedBeforeTheStore()])
elif args.case.startswith("kill_"):
    kind = args.case.removeprefix("kill_")
    kill_in_the_write(kind)
    fit(
        strategy=strategy(state_dict_type=kind), devices=args.devices, enable_checkpointing=True,
        callbacks=[KillMidSave(), checkpoints(kind)],
    )  # fmt: skip
elif args.case == "resume":
    for kind in ("full", "sharded"):
        path = os.path.join(args.out, f"good_{kind}.ckpt")
        trainer = fit_trainer(strategy(state_dict_type=kind), args.devices, ckpt_path=path)
        if trainer.global_rank == 0:
            torch.save(trainer.lightning_module.state_dict(), os.path.join(args.out, f"resumed_{kind}.pt"))
else:
    raise SystemExit(f"unknown case {args.case!r}")
