"""One measurement, run by the benchmark drivers as a fresh process: ``python benchmarks/_runs.py KIND [options]``.

Kinds (every process prints one JSON line through :func:`_harness.emit` at the end; ``lightning`` runs also one
``"event": "trained"`` line when training ends, before the strategy's teardown):

- ``lightning``: ``Trainer.fit`` of the MLP, AmoebaNet or translation module, plain (``--strategy plain``, one
  process) or under ``GPipeStrategy`` (``--strategy gpipe``; Lightning's launcher re-runs this script for the other
  stages).
  ``--count-saved`` also counts the bytes autograd saves, the inputs kept for re-computation and the gradients a
  deferred W keeps (see :class:`SavedBytes`, :class:`_StageCounter`), and every stage process reports
  ``rss_growth_mib``, its peak resident set during ``fit`` over the resident set at ``on_train_start``; such a
  process gives every allocation of 64 KiB or more its own mapping, returned to the system when freed
  (glibc's ``mallopt(M_MMAP_THRESHOLD)``), so that its resident set follows its live tensors, not the allocator's
  cache. That makes every such allocation fault its pages in anew, which slows the steps (AmoebaNet's layers ran
  1.6-2.2x slower): ``--default-allocator`` keeps glibc's own, for runs that measure time. ``--count-live``: every
  process also reports ``live_peak_mib``, the peak of its live tensors during training (:class:`LiveBytes`).
  A ``GPipeStrategy`` run that profiled its layers (``--balance time``) also reports ``layer_costs`` and ``resplit``
  (:func:`_split_check`) on rank 0.
  ``--schedule 1f1b``, ``zb-h1`` or ``zb-1p`` (also for ``bare``, where ``zb-1p`` places W by equal costs) runs
  ``GPipeStrategy(schedule=...)``.
- ``bare``: our engine (``ModelChunk``, ``Partition``, ``Link``) driven directly, without the Trainer; one process per
  stage, started by the driver with torch.distributed's environment variables.
- ``tp``: torch.distributed.pipelining's ``PipelineStage`` + ``ScheduleGPipe``; one process per stage, likewise.
  ``tp-1f1b``: the same with ``Schedule1F1B``.
- ``torchgpipe``: torchgpipe's ``GPipe`` in one process, one partition per ``"cpu"`` device.

Every process uses one torch thread (``torch.set_num_threads(1)``; the driver sets ``OMP_NUM_THREADS=1``).
"""

import argparse
import collections
import dataclasses
import sys
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: lightning_gpipe, benchmarks

from benchmarks import models  # noqa: E402
from benchmarks._harness import StepClock, emit, peak_rss_mib  # noqa: E402
from lightning_gpipe.engine.microbatch import tensors  # noqa: E402
from lightning_gpipe.engine.schedule import SCHEDULES  # noqa: E402

KINDS = ("lightning", "bare", "tp", "tp-1f1b", "tp-i1f1b", "tp-zb", "tp-zbv", "torchgpipe")


def _balance(text: str) -> str | list[int]:
    """``--balance``: a mode of ``GPipeStrategy(balance=...)``, or a comma-separated list of layers per stage."""
    if text in ("params", "time", "memory"):
        return text
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither params, time, memory nor a list like 4,4") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of one measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--model", choices=("mlp", "amoebanet", "translation"), default="mlp")
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="translation: padded tokens per side of its batch (default 4096)"
    )
    parser.add_argument("--strategy", choices=("plain", "gpipe"), default="gpipe", help="lightning only")
    parser.add_argument("--devices", type=int, default=2, help="processes: K, pipeline stages (K x D with --mesh)")
    parser.add_argument("--chunks", type=int, default=8, help="M, micro-batches")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="never")
    parser.add_argument(
        "--balance",
        type=_balance,
        default="params",
        help="lightning only: params, time, memory, or layers per (virtual) stage, comma-separated (default params)",
    )
    parser.add_argument("--batch-size", type=int, default=1024, help="rows (images) per mini-batch")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument(
        "--depth", type=int, help="mlp: (Linear, ReLU) pairs (default 8); translation: layers per side (default 3)"
    )
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--count-saved", action="store_true", help="lightning only: count autograd-saved bytes")
    parser.add_argument("--channels-last", action="store_true", help="lightning amoebanet only: channels_last")
    parser.add_argument(
        "--amoebanet-layers",
        type=int,
        default=6,
        help="lightning amoebanet only: L of AmoebaNet-D (L, 16) (default 6: 10 backbone layers; the 20-minute"
        " recipe's 3: 7)",
    )
    parser.add_argument(
        "--precision", help="lightning only: Trainer(precision=...), e.g. bf16-mixed (default: the Trainer's, 32-true)"
    )
    parser.add_argument(
        "--schedule",
        choices=tuple(SCHEDULES),
        help="lightning gpipe, bare (default: lightning gpipe leaves it unset, so the strategy chooses the B/W split;"
        " bare runs gpipe)",
    )
    parser.add_argument(
        "--offload", action="store_true", help='lightning gpipe only: GPipeStrategy(offload="activations")'
    )
    parser.add_argument(
        "--mesh",
        type=int,
        nargs=2,
        metavar=("K", "D"),
        help="lightning gpipe only: GPipeStrategy(pipeline_parallel_size=K, data_parallel_size=D), K x D = --devices"
        " (default: the strategy's own, one pipeline of --devices stages)",
    )
    parser.add_argument(
        "--sharding-strategy",
        choices=("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"),
        help="lightning gpipe only: GPipeStrategy(sharding_strategy=...), for a mesh of D > 1 (default: its own)",
    )
    parser.add_argument(
        "--local-layers",
        action="store_true",
        help="tp kinds: build only this rank's layers (on the meta device, then initialised), as a capped run needs;"
        " without it every rank builds the whole backbone, the same weights for every K",
    )
    parser.add_argument(
        "--virtual-stages", type=int, help="lightning gpipe only: GPipeStrategy(virtual_stages=...) (default: its own)"
    )
    parser.add_argument(
        "--defer-weight-grad",
        action=argparse.BooleanOptionalAction,
        help="lightning gpipe and bare: GPipeStrategy(defer_weight_grad=True) (--no-...: False; neither: None, the"
        " schedule's default)",
    )
    parser.add_argument(
        "--breakdown", action="store_true", help="lightning gpipe only: where each stage's step time goes (spans)"
    )
    parser.add_argument(
        "--plan-limit-mib",
        type=float,
        help="lightning gpipe only: GPipeStrategy(plan='auto', memory_limit=this many MiB); --chunks, --checkpoint,"
        " --schedule, --virtual-stages are passed only if named in --plan-fix; every process reports model_peak_mib"
        " (its peak resident set during training, less file-backed pages, over its anonymous memory before setup) and"
        " rank 0 the plan and its prediction",
    )
    fixable = ("chunks", "checkpoint", "schedule", "virtual_stages")
    parser.add_argument("--plan-fix", nargs="*", default=[], choices=fixable)
    parser.add_argument(
        "--plan-balance", type=int, nargs="+", help="with --plan-limit-mib: a balance list the planner keeps"
    )
    parser.add_argument(
        "--default-allocator",
        action="store_true",
        help="with --count-saved or --plan-limit-mib: keep glibc's allocator as a user has it, so that the step time"
        " is a user's (mapping every large allocation of its own makes each one fault its pages in: AmoebaNet's layers"
        " ran 1.6-2.2x slower so); the measured peak then includes the memory the allocator keeps",
    )
    parser.add_argument(
        "--count-live",
        action="store_true",
        help="lightning only: every process reports live_peak_mib, the peak of its live tensors during training"
        " (LiveBytes; it slows the run)",
    )
    args = parser.parse_args(argv)
    if args.mesh is not None and args.mesh[0] * args.mesh[1] != args.devices:
        parser.error(f"--mesh {args.mesh[0]} {args.mesh[1]} needs K x D = --devices {args.devices}")
    if args.depth is None:
        args.depth = 3 if args.model == "translation" else 8
    return args


def _batch(args: argparse.Namespace):
    if args.model == "amoebanet":
        return models.image_batch(args.batch_size)
    if args.model == "translation":
        return models.translation_batch(args.max_tokens)
    return models.mlp_batch(args.batch_size, args.width)


# --------------------------------------------------------------------------- autograd-saved bytes


class SavedBytes:
    """Counts the bytes autograd keeps for backward: live now, and the peak.

    Installed with ``torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)``. A saved
    tensor counts with the bytes of its storage, once however many graph nodes save it (a Linear's input and
    the ReLU output before it are one storage), and stops counting when the last node saving it is freed.
    Parameters (and their storages) are not activations and are not counted. A saved view of the mini-batch the
    loader gives (a micro-batch of it, as the first stage's layers save their input) counts with its own bytes, not
    its storage's (the whole mini-batch, held by the loader whatever the schedule).

    Args:
        params: the module's parameters.
        batch: the mini-batch's tensors.
    """

    def __init__(self, params, batch: Iterable[torch.Tensor] = ()) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.batch = {t.untyped_storage().data_ptr() for t in batch}
        self.refs: dict[int, int] = {}  # storage address (a view's own, for the batch) -> saving nodes alive
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, tensor: torch.Tensor) -> object:
        """Count ``tensor``'s storage while a node saves it; return a handle holding it."""
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self.batch:
            key, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        handle = _Handle(tensor)
        if key in self.params or storage.device.type == "meta":
            return handle
        if key not in self.refs:
            self.refs[key], self.sizes[key] = 0, size
            self.live += size
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(handle, self._release, key)
        return handle

    @staticmethod
    def unpack(handle: "_Handle") -> torch.Tensor:
        """The saved tensor."""
        return handle.tensor

    def kept_inputs(self, model_chunks: Iterable) -> int:
        """Bytes of the micro-batch inputs ``model_chunks`` (the process's
        ``lightning_gpipe.engine.model_chunk.ModelChunk`` objects) keep for re-computation now, in storages autograd
        does not already hold (read from their records, not changed)."""
        storages = {}
        for record in (record for chunk in model_chunks for record in chunk._records.values()):
            if record.output is None:
                for t in tensors(record.input):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(size for key, size in storages.items() if key not in self.refs)

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors alive in this process, now and at their peak: what a memory limit for the model
    covers (parameters, gradients, optimizer state, activations, batches, transfer buffers), without the process's
    own memory (the allocator's, the libraries', Python's), as ``torch.cuda.max_memory_allocated`` reads it on a GPU.

    A dispatch mode of the thread that enters it: every storage an operator returns or reads is counted once, from
    then until it is freed (``weakref.finalize`` on the storage, whose Python object torch keeps while the storage
    lives). A tensor another thread makes (a received payload) counts from its first use here. ``reset()`` starts
    a new peak from the bytes alive.

    Args:
        excluded: tensors made before the mode whose storages are not the model's and are never counted (the data
            set's own copy of the batch, which the loader copies from).
    """

    def __init__(self, excluded: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = {t.untyped_storage().data_ptr() for t in excluded}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in (*pytree.tree_leaves(out), *pytree.tree_leaves((args, kwargs))):
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._count(value.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        try:
            key, size = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # no data of its own (FSDP2's sharded parameters': "invalid python storage")
            return
        if not key or key in self.counted:
            return
        self.counted.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self.counted.discard(key)
        self.live -= size

    def reset(self) -> None:
        """Start the peak again from the bytes alive now."""
        self.peak = self.live


class _Handle:
    """A saved tensor, detached: a node's own output saved with its ``grad_fn`` would make a cycle through autograd's
    graph that Python's collector cannot see, and a graph kept for a deferred W (``retain_graph=True``) would never be
    freed, nor counted as freed."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


# --------------------------------------------------------------------------- lightning


def run_lightning(args: argparse.Namespace) -> None:
    """Fit plain or under GPipeStrategy; every process emits its step clock (and saved bytes if counted)."""
    import lightning.pytorch as pl

    class Clock(pl.Callback):
        """Marks step ends; reports when training ends; samples the stage's kept inputs after each fill; measures
        the growth of the resident set during fit."""

        def __init__(self) -> None:
            self.clock = StepClock(args.warmup)
            self.rss_start = self.rss_growth = None

        def setup(self, trainer, pl_module, stage) -> None:
            self.anon_setup = _status_mib("RssAnon")  # before the strategy materialises this stage's layers

        def on_train_start(self, trainer, pl_module) -> None:
            self.rss_start = _reset_peak_rss()
            self.anon_start = _status_mib("RssAnon")
            if live is not None:
                live.reset()  # the planner's profile is not training

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.clock.mark()

        def on_train_end(self, trainer, pl_module) -> None:
            # before the strategy's teardown, which may gather the whole model on rank 0
            if self.rss_start is not None:
                self.rss_growth = _status_mib("VmHWM") - self.rss_start
                # the peak of anonymous memory (tensors, heap) since setup: the peak resident set less the
                # file-backed pages (code, libraries) and shared memory resident at the end
                files = _status_mib("RssFile") + _status_mib("RssShmem")
                self.model_peak = _status_mib("VmHWM") - files - self.anon_setup
            if live is not None:
                self.live_peak = live.peak / 2**20
            emit(trainer.global_rank, event="trained", steps=len(self.clock.ends), peak_rss_mib=peak_rss_mib())

    torch.manual_seed(0)
    if args.model == "amoebanet":
        module = models.amoebanet_classifier(args.amoebanet_layers, channels_last=args.channels_last)
    elif args.model == "translation":
        module = models.translation_module(args.depth)
    else:
        module = models.MLPClassifier(args.width, args.depth, momentum=args.momentum)
    batch = _batch(args)
    data = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]

    def model_chunks() -> list:  # the trainer is made below; the strategy's run exists from setup to teardown
        run = getattr(trainer.strategy, "run", None)
        return run.pipeline._model_chunks if run is not None else []

    counter = _StageCounter(module, model_chunks, data) if args.count_saved else None
    live = LiveBytes(excluded=data) if args.count_live else None
    callback = Clock()
    breakdown = step_breakdown(args.warmup) if args.breakdown else None
    # the saved bytes sampled at the end of a fill, only when counting: a callback's on_before_backward makes
    # every stage swap its random streams twice a step
    fill_end = None
    if counter is not None:
        fill_end = pl.callbacks.LambdaCallback(
            on_train_start=lambda *_: counter.restart(), on_before_backward=lambda *_: counter.sample()
        )
    trainer_kwargs = {
        "accelerator": "cpu",
        "max_steps": args.warmup + args.steps,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "use_distributed_sampler": False,
        **({"precision": args.precision} if args.precision else {}),
        "callbacks": [callback, *(extra for extra in (breakdown, fill_end) if extra is not None)],
    }
    if args.strategy == "plain":
        trainer = pl.Trainer(devices=1, **trainer_kwargs)
    else:
        from lightning_gpipe import GPipeStrategy

        options = {
            "chunks": args.chunks, "checkpoint": args.checkpoint, "schedule": args.schedule,
            "virtual_stages": args.virtual_stages,
        }  # fmt: skip
        if args.plan_limit_mib is not None:
            options = {key: value for key, value in options.items() if key in args.plan_fix}
            options.update(plan="auto", memory_limit=int(args.plan_limit_mib * 2**20))
            options.update({"balance": args.plan_balance} if args.plan_balance else {})
        else:
            options.update(balance=args.balance)
        options.update({"offload": "activations"} if args.offload else {})
        if args.mesh is not None:
            options.update(pipeline_parallel_size=args.mesh[0], data_parallel_size=args.mesh[1])
        options.update({"sharding_strategy": args.sharding_strategy} if args.sharding_strategy else {})
        strategy = GPipeStrategy(defer_weight_grad=args.defer_weight_grad, **options)
        trainer = pl.Trainer(strategy=strategy, devices=args.devices, **trainer_kwargs)
    loader = models.repeat_loader(batch, args.warmup + args.steps, fresh=args.plan_limit_mib is not None)
    if counter is not None:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            trainer.fit(module, loader)
    elif live is not None:
        with live:
            trainer.fit(module, loader)
    else:
        trainer.fit(module, loader)
    record = {**callback.clock.summary(), "threads": torch.get_num_threads(), "world_size": trainer.world_size}
    if args.strategy != "plain":
        config = trainer.strategy.config  # what ran: given, or the default's choice
        record.update(split=config.splits_backward, virtual_stages=config.virtual_stages)
        # rank 0's only (every stage profiles alike): the stages share one stdout, and lines longer than a pipe's
        # atomic write (4 KiB) from several of them interleave (768 layers' costs on 4 stages broke the records)
        if trainer.global_rank == 0:
            record.update(_split_check(trainer.strategy))
    if counter is not None:
        record.update(saved_peak=counter.counter.peak, kept_inputs=counter.kept, peak=counter.peak)
        record.update(kept_for_weights=counter.kept_for_weights, peak_with_weights=counter.peak_with_weights)
    if callback.rss_growth is not None:
        record.update(rss_growth_mib=callback.rss_growth)
        record.update(model_peak_mib=callback.model_peak, anon_mib=[callback.anon_setup, callback.anon_start])
    if live is not None:
        record.update(live_peak_mib=callback.live_peak)
    if args.plan_limit_mib is not None and trainer.global_rank == 0:
        report = trainer.strategy.plan_report
        record.update(plan=report.as_dict()["chosen"], profiled=dataclasses.asdict(report.profiled))
        record.update(state_factor=report.state_factor, limit=report.memory_limit)
    if breakdown is not None:
        record.update(breakdown=breakdown.mean_ms(), stage=trainer.strategy.stage_index)
    emit(trainer.global_rank, **record)


def _split_check(strategy) -> dict:
    """What a strategy that profiled its layers (``--balance time``) kept (nothing for the others): ``layer_costs``,
    the profiled cost of each backbone layer for one micro-batch (``LayerCost``'s fields), and ``resplit``, the record
    of its check of the split against the measured stage times (``strategy.resplit.record``: ``None`` where the check
    has not run, e.g. before its steps)."""
    if strategy.layer_costs is None:
        return {}
    check = getattr(strategy, "resplit", None)
    costs = [dataclasses.asdict(cost) for cost in strategy.layer_costs]
    return {"layer_costs": costs, "resplit": None if check is None else check.record}


def step_breakdown(warmup: int):
    """A callback recording where one stage's training steps go, from the stage's own spans.

    Each measured step is the period from one ``on_train_batch_start`` to the next (so the parts add up to
    the measured period): the stage's spans (``forward``, ``recompute``, ``backward``, ``loss``, ``send``,
    ``recv``, ``relay``), ``optimizer`` (from ``on_before_optimizer_step`` to ``on_train_batch_end``: the step
    and Lightning's hooks after it), ``lightning in step`` (the rest of the batch hooks' interval: the user's
    step before the backbone call, zero_grad, Lightning's hooks) and ``between steps`` (from
    ``on_train_batch_end`` to the next ``on_train_batch_start``: the data loader and the loop's bookkeeping).
    Its ``mean_ms()`` gives the mean milliseconds per measured step of each part and of the whole ``period``.

    Args:
        warmup: steps not measured at the start.
    """
    import time

    import lightning.pytorch as pl

    class StepBreakdown(pl.Callback):
        def __init__(self) -> None:
            self.batch, self.steps = -1, []
            self.start = self.optimizer = self.end = 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self.batch >= warmup:
                self.steps[-1].update({"between steps": now - self.end, "period": now - self.start})
            self.batch, self.start = self.batch + 1, now
            events = trainer.strategy.run.events
            events.take()
            events.enabled = True

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.optimizer = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.end = time.perf_counter()
            events = trainer.strategy.run.events
            spans, events.enabled = events.take(), False
            if self.batch < warmup:
                return
            parts: dict[str, float] = {}
            for span in spans:
                parts[span.kind] = parts.get(span.kind, 0.0) + span.end - span.start
            parts["optimizer"] = self.end - self.optimizer
            parts["lightning in step"] = self.end - self.start - sum(parts.values())
            self.steps.append(parts)

        def mean_ms(self) -> dict[str, float]:
            complete = [step for step in self.steps if "period" in step]
            kinds = sorted({kind for step in complete for kind in step})
            return {kind: 1e3 * sum(step.get(kind, 0.0) for step in complete) / len(complete) for kind in kinds}

    return StepBreakdown()


class _StageCounter:
    """A :class:`SavedBytes` made anew when training starts (:meth:`restart`), once the strategy's setup has built and
    split the module's layers: what setup saved (a profile of the layers) is not counted, and the parameters excluded
    are those the stage trains (setup may replace the module's).

    At every saved tensor, after every backward and before every deferred W of the stage's model chunks (and at each
    :meth:`sample`) it also samples the micro-batch inputs the model chunks keep for re-computation and, under a B/W
    split, the gradients their queued W keep (``DeferredWeightGradient.kept_bytes``; what autograd saves for W is
    counted as saved): ``kept`` and ``kept_for_weights`` are their largest bytes, ``peak`` the largest sum of the live
    saved bytes and the kept inputs (the tracked allocations of the 1F1B memory bar), ``peak_with_weights`` that sum
    with the gradients kept for W.

    Args:
        module: the LightningModule.
        model_chunks: returns the strategy's current ``ModelChunk`` objects (none without a split).
        batch: the mini-batch's tensors (see :class:`SavedBytes`).
    """

    def __init__(self, module: torch.nn.Module, model_chunks, batch: Iterable[torch.Tensor] = ()) -> None:
        self.module, self.model_chunks, self.batch = module, model_chunks, list(batch)
        self._reset()

    def pack(self, tensor: torch.Tensor) -> object:
        """:meth:`SavedBytes.pack`, then :meth:`sample`."""
        handle = self.counter.pack(tensor)
        self.sample()
        return handle

    def sample(self) -> None:
        """Update ``kept``, ``kept_for_weights``, ``peak`` and ``peak_with_weights`` with the bytes held now."""
        chunks = self.model_chunks()
        kept = self.counter.kept_inputs(chunks)
        weights = sum(weight.kept_bytes for chunk in chunks for _, weight, _ in chunk._weights)
        self.kept, self.kept_for_weights = max(self.kept, kept), max(self.kept_for_weights, weights)
        self.peak = max(self.peak, self.counter.live + kept)
        self.peak_with_weights = max(self.peak_with_weights, self.counter.live + kept + weights)

    def restart(self) -> None:
        """Count from now on, with the module's parameters as they are now; sample around the model chunks'
        backwards from now on."""
        self._reset()
        for chunk in self.model_chunks():
            if "backward" not in vars(chunk):  # not wrapped yet
                chunk.backward = _sampling(chunk.backward, self.sample, before=False)
                chunk.backward_weights = _sampling(chunk.backward_weights, self.sample, before=True)

    def _reset(self) -> None:
        self.counter = SavedBytes(self.module.parameters(), self.batch)
        self.kept = self.kept_for_weights = self.peak = self.peak_with_weights = 0

    unpack = staticmethod(SavedBytes.unpack)


def _sampling(call, sample, before: bool):
    """``call`` with ``sample()`` run before it (``before``) or after it."""

    def run(*args):
        if before:
            sample()
        result = call(*args)
        if not before:
            sample()
        return result

    return run


def _map_large_allocations() -> None:
    """Give every allocation of 64 KiB or more its own mapping, unmapped when freed (glibc; elsewhere nothing)."""
    import ctypes

    libc = ctypes.CDLL(None)
    if hasattr(libc, "mallopt"):
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; a fixed one also stops glibc from raising it


def _status_mib(field: str) -> float:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``: kB) in MiB."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak_rss():
    """Reset this process's peak resident set (``VmHWM``) to the current one; return the current one (MiB), or
    ``None`` where Linux's ``/proc/self/clear_refs`` is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mib("VmRSS")
    except OSError:
        return None


# --------------------------------------------------------------------------- without Lightning


def _local_layers(args: argparse.Namespace, rank: int, world: int) -> tuple[dict, torch.nn.Module]:
    """This stage's backbone layers (by original name, split as GPipeStrategy splits them) and the head."""
    parts, head = _parts(args, world)
    return parts[rank], head


def _parts(args: argparse.Namespace, count: int) -> tuple[list[dict], torch.nn.Module]:
    """The backbone split into ``count`` parts by parameters as GPipeStrategy splits it (layers by original
    name), and the head; the same initial weights for every ``count``."""
    from lightning_gpipe.planning.balance import resolve_balance

    torch.manual_seed(0)
    with torch.device("meta" if args.local_layers else "cpu"):
        backbone = models.mlp_backbone(args.width, args.depth)
        head = torch.nn.Linear(args.width, models.NUM_CLASSES)
    names, parts, start = list(backbone._modules), [], 0
    for size in resolve_balance(None, backbone, count):
        parts.append({name: backbone._modules[name] for name in names[start : start + size]})
        start += size
    return parts, head


def _materialized(layers: list[torch.nn.Module]) -> None:
    """Give ``layers``, built on the meta device (``--local-layers``), memory and their default initialisation."""
    for layer in layers:
        if any(p.is_meta for p in layer.parameters()):
            layer.to_empty(device="cpu")
            layer.reset_parameters()


def _train(step, params, args: argparse.Namespace, rank: int, split: bool = False, virtual_stages: int = 1) -> None:
    """Run ``step()`` for the warm-up and measured steps with an SGD update after each; emit the clock, with what
    this process ran: ``split`` (backwards split into B and W), ``virtual_stages`` (model chunks it holds)."""
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=args.momentum)
    clock = StepClock(args.warmup)
    for _ in range(args.warmup + args.steps):
        optimizer.zero_grad()
        step()
        optimizer.step()
        clock.mark()
    emit(rank, **clock.summary(), threads=torch.get_num_threads(), split=split, virtual_stages=virtual_stages)


def run_bare(args: argparse.Namespace) -> None:
    """Our engine (either schedule) through its front door (``build_pipeline``, ``StagePipeline``) in torch.distributed
    processes, no Trainer: the engine's own cost."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_gpipe.engine import DEFERRED_BY_DEFAULT, StageSpec, Topology, build_pipeline
    from lightning_gpipe.faults.job import Job
    from lightning_gpipe.planning.balance import resolve_balance

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (whole,), head = _parts(args, 1)  # the layers and weights every run uses, split below as GPipeStrategy splits
    module = torch.nn.Module()
    module.backbone = torch.nn.Sequential(collections.OrderedDict(whole))
    schedule = args.schedule or "gpipe"
    defer = DEFERRED_BY_DEFAULT[schedule] if args.defer_weight_grad is None else args.defer_weight_grad
    balance = resolve_balance(None, module.backbone, world)
    spec = StageSpec(Topology(world, world), rank, torch.device("cpu"), balance, schedule, args.chunks,
                     args.checkpoint, defer)  # fmt: skip
    pipeline = build_pipeline(module, "backbone", spec, Job())
    x, y = _batch(args)

    def micro_batch_loss(i: int, count: int, out: torch.Tensor) -> None:  # 1F1B: the loss of rows i, row-weighted
        target = torch.tensor_split(y, count)[i]
        (F.cross_entropy(head(out), target) * (len(target) / len(y))).backward()

    def step() -> None:
        if pipeline.loss_per_micro_batch:
            pipeline.forward(x, micro_batch_loss)
            return
        out = pipeline.forward(x)
        if pipeline.is_last:
            F.cross_entropy(head(out), y).backward()
        pipeline.backward()

    params = [*pipeline.partition.parameters(), *(head.parameters() if pipeline.is_last else [])]
    _train(step, params, args, rank, split=defer)
    dist.destroy_process_group()


def run_tp(args: argparse.Namespace) -> None:
    """torch.distributed.pipelining: ``PipelineStage`` of this rank's layers (+ head on the last), ``ScheduleGPipe``
    (``tp``) or ``Schedule1F1B`` (``tp-1f1b``)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layers, head = _local_layers(args, rank, world)
    module = torch.nn.Sequential(*layers.values(), *([head] if rank == world - 1 else []))
    _materialized(list(module))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = (Schedule1F1B if args.kind == "tp-1f1b" else ScheduleGPipe)(stage, args.chunks, loss_fn=F.cross_entropy)
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


def run_tp_zero_bubble(args: argparse.Namespace) -> None:
    """torch.distributed.pipelining's schedules with 2 stages per rank: ``tp-i1f1b`` (ScheduleInterleaved1F1B)
    and ``tp-zb`` (ScheduleInterleavedZeroBubble), where rank r holds stages r and r + K, and ``tp-zbv``
    (ScheduleZBVZeroBubble: the V shape, rank r holds stages r and 2K - 1 - r). The backbone is split into 2K parts
    by parameters."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = 2 * world
    parts, head = _parts(args, total)
    ids = [rank, total - 1 - rank] if args.kind == "tp-zbv" else [rank, rank + world]
    modules = [torch.nn.Sequential(*parts[i].values(), *([head] if i == total - 1 else [])) for i in ids]
    _materialized([layer for module in modules for layer in module])
    stages = [PipelineStage(m, i, total, torch.device("cpu")) for m, i in zip(modules, ids)]
    kinds = {"tp-i1f1b": ScheduleInterleaved1F1B, "tp-zb": ScheduleInterleavedZeroBubble}
    kind = kinds.get(args.kind, ScheduleZBVZeroBubble)
    schedule = kind(stages, args.chunks, loss_fn=F.cross_entropy)
    x, y = _batch(args)
    first, last = 0 in ids, total - 1 in ids

    def step() -> None:
        schedule.step(*([x] if first else []), **({"target": y} if last else {}))

    params = [p for m in modules for p in m.parameters()]
    _train(step, params, args, rank, split=args.kind != "tp-i1f1b", virtual_stages=len(modules))
    dist.destroy_process_group()


def run_torchgpipe(args: argparse.Namespace) -> None:
    """torchgpipe's ``GPipe`` over ``devices`` CPU partitions in this one process (a worker thread per partition)."""
    import torch.nn.functional as F
    from torchgpipe import GPipe

    layers, head = _local_layers(args, 0, 1)
    sequential = torch.nn.Sequential(*layers.values(), head)
    from lightning_gpipe.planning.balance import resolve_balance

    balance = resolve_balance(None, torch.nn.Sequential(*layers.values()), args.devices)
    balance[-1] += 1  # the head, on the last partition as in the other pipelines
    model = GPipe(sequential, balance, devices=["cpu"] * args.devices, chunks=args.chunks, checkpoint=args.checkpoint)
    x, y = _batch(args)
    step = lambda: F.cross_entropy(model(x), y).backward()  # noqa: E731
    _train(step, list(model.parameters()), args, 0, virtual_stages=args.devices)  # every partition in this process


def main(argv: list[str] | None = None) -> None:
    """Make the measurement the arguments describe."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    if (args.count_saved or args.plan_limit_mib is not None) and not args.default_allocator:
        _map_large_allocations()
    runs = {"lightning": run_lightning, "bare": run_bare, "tp": run_tp, "torchgpipe": run_torchgpipe}
    runs.update({"tp-zb": run_tp_zero_bubble, "tp-zbv": run_tp_zero_bubble, "tp-i1f1b": run_tp_zero_bubble})
    runs.update({"tp-1f1b": run_tp})
    runs[args.kind](args)


if __name__ == "__main__":
    main()
