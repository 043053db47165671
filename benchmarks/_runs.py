"""One measurement, run by the benchmark drivers as a fresh process: ``python benchmarks/_runs.py KIND [options]``.

Kinds (every process prints one JSON line through :func:`_harness.emit` at the end; ``lightning`` runs also one
``"event": "trained"`` line when training ends, before the strategy's teardown):

- ``lightning``: ``Trainer.fit`` of the MLP or AmoebaNet module, plain (``--strategy plain``, one process) or
  under ``GPipeStrategy`` (``--strategy gpipe``; Lightning's launcher re-runs this script for the other stages).
  ``--count-saved`` also counts the bytes autograd saves (see :class:`SavedBytes`).
- ``bare``: our engine (``Stage``, ``Partition``, ``Link``) driven directly, without the Trainer; one process per
  stage, started by the driver with torch.distributed's environment variables.
- ``tp``: torch.distributed.pipelining's ``PipelineStage`` + ``ScheduleGPipe``; one process per stage, likewise.
- ``torchgpipe``: torchgpipe's ``GPipe`` in one process, one partition per ``"cpu"`` device.

Every process uses one torch thread (``torch.set_num_threads(1)``; the driver sets ``OMP_NUM_THREADS=1``).
"""

import argparse
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: lightning_gpipe, benchmarks

from benchmarks import models  # noqa: E402
from benchmarks._harness import StepClock, emit, peak_rss_mib  # noqa: E402
from lightning_gpipe.microbatch import tensors  # noqa: E402

KINDS = ("lightning", "bare", "tp", "torchgpipe")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of one measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--model", choices=("mlp", "amoebanet"), default="mlp")
    parser.add_argument("--strategy", choices=("plain", "gpipe"), default="gpipe", help="lightning only")
    parser.add_argument("--devices", type=int, default=2, help="K, pipeline stages")
    parser.add_argument("--chunks", type=int, default=8, help="M, micro-batches")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    parser.add_argument("--balance", choices=("params", "time", "memory"), default="params", help="lightning only")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows (images) per mini-batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--count-saved", action="store_true", help="lightning only: count autograd-saved bytes")
    return parser.parse_args(argv)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    if args.model == "amoebanet":
        return models.image_batch(args.batch_size)
    return models.mlp_batch(args.batch_size, args.width)


# --------------------------------------------------------------------------- autograd-saved bytes


class SavedBytes:
    """Counts the bytes autograd keeps for backward: live now, and the peak.

    Installed with ``torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)``. A saved
    tensor counts with the bytes of its storage, once however many graph nodes save it (a Linear's input and
    the ReLU output before it are one storage), and stops counting when the last node saving it is freed.
    Parameters (and their storages) are not activations and are not counted.

    Args:
        params: the module's parameters.
    """

    def __init__(self, params) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}  # storage address -> saving nodes alive
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``'s storage while a node saves it; return a handle holding it."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        handle = _Handle(tensor)
        if key in self.params or storage.device.type == "meta":
            return handle
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def unpack(handle: "_Handle") -> torch.Tensor:
        """The saved tensor."""
        return handle.tensor

    def kept_inputs(self, stage) -> int:
        """Bytes of the micro-batch inputs ``stage`` (a ``lightning_gpipe.stage.Stage``, or ``None``) keeps for
        re-computation now, in storages autograd does not already hold (read from its records, not changed)."""
        storages = {}
        for record in stage._records.values() if stage is not None else []:
            if record.output is None:
                for t in tensors(record.input):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(size for key, size in storages.items() if key not in self.refs)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


class _Handle:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


# --------------------------------------------------------------------------- lightning


def run_lightning(args: argparse.Namespace) -> None:
    """Fit plain or under GPipeStrategy; every process emits its step clock (and saved bytes if counted)."""
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        """Marks step ends; reports when training ends; reads the stage's kept inputs after each fill."""

        def __init__(self) -> None:
            self.clock = StepClock(args.warmup)
            self.kept: list[int] = []  # bytes of micro-batch inputs kept for re-computation, after each fill

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.clock.mark()

        def on_train_end(self, trainer, pl_module) -> None:
            # before the strategy's teardown, which may gather the whole model on rank 0
            emit(trainer.global_rank, event="trained", steps=len(self.clock.ends), peak_rss_mib=peak_rss_mib())

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if counter is not None and counter.counter is not None:
                self.kept.append(counter.counter.kept_inputs(trainer.strategy.stage))

    torch.manual_seed(0)
    if args.model == "amoebanet":
        module = models.amoebanet_classifier()
    else:
        module = models.MLPClassifier(args.width, args.depth, momentum=args.momentum)
    counter = _Deferred(module) if args.count_saved else None
    callback = Clock()
    trainer_kwargs = {
        "accelerator": "cpu",
        "max_steps": args.warmup + args.steps,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        "callbacks": [callback],
    }
    if args.strategy == "plain":
        trainer = pl.Trainer(devices=1, **trainer_kwargs)
    else:
        from lightning_gpipe import GPipeStrategy

        strategy = GPipeStrategy(balance=args.balance, chunks=args.chunks, checkpoint=args.checkpoint)
        trainer = pl.Trainer(strategy=strategy, devices=args.devices, **trainer_kwargs)
    loader = models.repeat_loader(_batch(args), args.warmup + args.steps)
    if counter is not None:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            trainer.fit(module, loader)
    else:
        trainer.fit(module, loader)
    record = {**callback.clock.summary(), "threads": torch.get_num_threads(), "world_size": trainer.world_size}
    if counter is not None:
        record.update(saved_peak=counter.counter.peak, kept_inputs=max(callback.kept, default=0))
    emit(trainer.global_rank, **record)


class _Deferred:
    """A :class:`SavedBytes` made at the first saved tensor, once the module's layers are built and split."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module, self.counter = module, None

    def pack(self, tensor: torch.Tensor) -> object:
        """:meth:`SavedBytes.pack`, making the counter first if needed."""
        if self.counter is None:
            self.counter = SavedBytes(self.module.parameters())
        return self.counter.pack(tensor)

    unpack = staticmethod(SavedBytes.unpack)


# --------------------------------------------------------------------------- without Lightning


def _local_layers(args: argparse.Namespace, rank: int, world: int) -> tuple[dict, torch.nn.Module]:
    """This stage's backbone layers (by original name, split as GPipeStrategy splits them) and the head."""
    from lightning_gpipe.partition import resolve_balance

    torch.manual_seed(0)
    backbone = models.mlp_backbone(args.width, args.depth)
    head = torch.nn.Linear(args.width, models.NUM_CLASSES)
    balance = resolve_balance(None, backbone, world)
    start = sum(balance[:rank])
    names = list(backbone._modules)[start : start + balance[rank]]
    return {name: backbone._modules[name] for name in names}, head


def _train(step, params, args: argparse.Namespace, rank: int) -> None:
    """Run ``step()`` for the warm-up and measured steps with an SGD update after each; emit the clock."""
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=args.momentum)
    clock = StepClock(args.warmup)
    for _ in range(args.warmup + args.steps):
        optimizer.zero_grad()
        step()
        optimizer.step()
        clock.mark()
    emit(rank, **clock.summary(), threads=torch.get_num_threads())


def run_bare(args: argparse.Namespace) -> None:
    """Our GPipe schedule over Stage/Partition/Link in torch.distributed processes, no Trainer: the engine's own
    cost."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_gpipe.partition import Partition
    from lightning_gpipe.schedule import GPipe
    from lightning_gpipe.stage import Stage
    from lightning_gpipe.transfer import Link

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers, head = _local_layers(args, rank, world)
    partition = Partition(layers)
    link = Link(rank - 1 if rank > 0 else None, rank + 1 if rank < world - 1 else None, torch.device("cpu"))
    stage = Stage(partition, link, rank, world, args.chunks, args.checkpoint)
    schedule = GPipe(stage)
    x, y = _batch(args)

    def step() -> None:
        out = schedule.forward(x)
        if stage.is_last:
            F.cross_entropy(head(out), y).backward()
        schedule.backward()

    params = [*partition.parameters(), *(head.parameters() if stage.is_last else [])]
    _train(step, params, args, rank)
    dist.destroy_process_group()


def run_tp(args: argparse.Namespace) -> None:
    """torch.distributed.pipelining: ``PipelineStage`` of this rank's layers (+ head on the last), ``ScheduleGPipe``."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers, head = _local_layers(args, rank, world)
    module = torch.nn.Sequential(*layers.values(), *([head] if rank == world - 1 else []))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, args.chunks, loss_fn=F.cross_entropy)
    x, y = _batch(args)

    def step() -> None:
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()

    _train(step, list(module.parameters()), args, rank)
    dist.destroy_process_group()


def run_torchgpipe(args: argparse.Namespace) -> None:
    """torchgpipe's ``GPipe`` over ``devices`` CPU partitions in this one process (a worker thread per partition)."""
    import torch.nn.functional as F
    from torchgpipe import GPipe

    layers, head = _local_layers(args, 0, 1)
    sequential = torch.nn.Sequential(*layers.values(), head)
    from lightning_gpipe.partition import resolve_balance

    balance = resolve_balance(None, torch.nn.Sequential(*layers.values()), args.devices)
    balance[-1] += 1  # the head, on the last partition as in the other pipelines
    model = GPipe(sequential, balance, devices=["cpu"] * args.devices, chunks=args.chunks, checkpoint=args.checkpoint)
    x, y = _batch(args)
    _train(lambda: F.cross_entropy(model(x), y).backward(), list(model.parameters()), args, 0)


def main(argv: list[str] | None = None) -> None:
    """Make the measurement the arguments describe."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    {"lightning": run_lightning, "bare": run_bare, "tp": run_tp, "torchgpipe": run_torchgpipe}[args.kind](args)


if __name__ == "__main__":
    main()
