"""One measurement of benchmarks/compile.py, a fresh process: ``python benchmarks/_compile_run.py MODEL [options]``.

``Trainer.fit`` of AmoebaNet-D (6, 16) on one repeated batch of random 32 x 32 images (``amoebanet``), or of the
translation example's Transformer (``examples/translation/configs/cpu.yaml``'s model, without decoding) on the
shipped Multi30k subset in token-bucketed batches of varying shape (``translation``), under
``GPipeStrategy(compile=...)`` on ``--devices`` processes of one torch thread each (Lightning's launcher re-runs this
script for the other stages). Every process prints one JSON line (:func:`_harness.emit`): the step clock's summary
of the steps after ``--warmup`` (``median_s`` ...), ``first_s`` (the first step, where compiling happens),
``warmup_s`` (all warm-up steps), and ``frames_compiled`` / ``frames_measured`` (the frames Dynamo compiled in all,
and while the measured steps ran: recompiles for new shapes).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # lightning_gpipe, benchmarks
sys.path.insert(0, str(REPO / "examples"))  # translation

from benchmarks import models  # noqa: E402
from benchmarks._harness import StepClock, emit  # noqa: E402
from lightning_gpipe.engine.schedule import SCHEDULES  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of one measurement (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", choices=("amoebanet", "translation"))
    parser.add_argument("--compile", default="false", help="GPipeStrategy(compile=...): false, true, or a JSON dict")
    parser.add_argument("--devices", type=int, default=2, help="K, pipeline stages")
    parser.add_argument("--chunks", type=int, default=4, help="M, micro-batches")
    parser.add_argument("--checkpoint", choices=("never", "except_last", "always"), default="except_last")
    parser.add_argument("--schedule", choices=tuple(SCHEDULES), default="gpipe")
    parser.add_argument("--batch-size", type=int, default=64, help="amoebanet: images per mini-batch")
    parser.add_argument("--max-tokens", type=int, default=2048, help="translation: padded tokens per side per batch")
    parser.add_argument("--steps", type=int, default=8, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the measured ones (compiling included)")
    return parser.parse_args(argv)


def compile_value(text: str) -> bool | dict:
    """``--compile``'s value as ``GPipeStrategy(compile=...)`` takes it."""
    value = json.loads(text)
    if not isinstance(value, (bool, dict)):
        raise SystemExit(f"--compile {text}: give false, true or a JSON object")
    return value


def main(argv: list[str] | None = None) -> None:
    """Fit and emit this process's measurement."""
    import lightning.pytorch as pl
    from torch._dynamo.utils import counters

    from lightning_gpipe import GPipeStrategy

    args = parse_args(argv)
    torch.set_num_threads(1)

    class Clock(pl.Callback):
        """Marks step ends and the start of the first step; counts Dynamo's frames when the measured steps start."""

        def __init__(self) -> None:
            self.clock, self.start, self.frames_before = StepClock(args.warmup), None, 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 0:
                self.start = time.perf_counter()
            if batch_idx == args.warmup:
                self.frames_before = counters["frames"]["ok"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.clock.mark()

    torch.manual_seed(0)
    pl.seed_everything(0, verbose=False)
    if args.model == "amoebanet":
        module = models.amoebanet_classifier()
        data = models.repeat_loader(models.image_batch(args.batch_size), args.warmup + args.steps)
    else:
        from translation.data import TranslationDataModule
        from translation.module import TranslationModule

        module = TranslationModule(decode=False)
        data = TranslationDataModule(max_tokens=args.max_tokens, val_rows=4)
    callback = Clock()
    strategy = GPipeStrategy(
        chunks=args.chunks, checkpoint=args.checkpoint, schedule=args.schedule, compile=compile_value(args.compile)
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        devices=args.devices,
        max_steps=args.warmup + args.steps,
        max_epochs=None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    trainer.fit(module, data)
    ends = callback.clock.ends
    emit(
        trainer.global_rank,
        **callback.clock.summary(),
        first_s=ends[0] - callback.start,
        warmup_s=ends[args.warmup - 1] - callback.start,
        frames_compiled=counters["frames"]["ok"],
        frames_measured=counters["frames"]["ok"] - callback.frames_before,
        threads=torch.get_num_threads(),
    )


if __name__ == "__main__":
    main()
