"""Distributed worker: clipping, accumulation, mixed precision, meta-device init, checkpoints and resume.

Usage: python production.py OUT_DIR --devices K [--resume-only]
Each scenario trains a freshly seeded TupleNet (see ``SCENARIOS``) and writes rank 0's module state
after fit to OUT_DIR/<scenario>.pt. Checkpoints are written at step 3 (the end of the first epoch,
where Lightning resumes exactly) to OUT_DIR/full.ckpt (one file) and OUT_DIR/sharded.ckpt (a
directory), then training resumes from each to step 6: OUT_DIR/resume_{full,sharded}_K{K}.pt.
With --resume-only, only the resumes run (from checkpoints written by an earlier run with another K).
``trainer.validate`` of a fresh (seed 1) TupleNet writes its metrics to OUT_DIR/validate.json.
Per-rank facts go to OUT_DIR/<scenario>_rank{r}.json (local parameter count right after setup,
the gradient scaler's final scale).
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from models import LazyNet, TupleNet, fit_trainer, loader, trainer_kwargs  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
parser.add_argument("--resume-only", action="store_true")
args = parser.parse_args()
rank = int(os.environ.get("LOCAL_RANK", "0"))


class Facts(Callback):
    """Records what each stage holds right after setup, and the scaler's scale at the end."""

    def __init__(self, name: str) -> None:
        self.name, self.facts = name, {}

    def on_fit_start(self, trainer, module):
        parameters = list(module.parameters())
        self.facts["local_parameters"] = sum(p.numel() for p in parameters)
        self.facts["meta_parameters"] = sum(p.numel() for p in parameters if p.is_meta)

    def on_fit_end(self, trainer, module):
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.facts["scale"] = scaler.get_scale() if scaler is not None else None
        with open(os.path.join(args.out, f"{self.name}_rank{rank}.json"), "w") as f:
            json.dump(self.facts, f)


def fp16_plugin():
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))


SCENARIOS = {
    "clip_norm": dict(gradient_clip_val=0.05),
    "clip_value": dict(gradient_clip_val=0.01, gradient_clip_algorithm="value"),
    "accumulate": dict(accumulate_grad_batches=2),
    "bf16": dict(precision="bf16-mixed"),
    "fp16": dict(plugins=[fp16_plugin()]),
    "configure_model": dict(module=LazyNet()),
    "sanity_check": dict(num_sanity_val_steps=2, val_check_interval=2),
}


def run(name: str, strategy: lightning_gpipe.GPipeStrategy, **kwargs) -> L.Trainer:
    facts = Facts(name)
    callbacks = kwargs.pop("callbacks", []) + [facts]
    trainer = fit_trainer(strategy, args.devices, callbacks=callbacks, **kwargs)
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(args.out, f"{name}.pt"))
    return trainer


def write_checkpoint(state_dict_type: str) -> None:
    every_3 = ModelCheckpoint(dirpath=args.out, filename=state_dict_type, every_n_train_steps=3, save_top_k=-1)
    strategy = lightning_gpipe.GPipeStrategy(chunks=3, state_dict_type=state_dict_type)
    run(f"{state_dict_type}_at_3", strategy, max_steps=3, enable_checkpointing=True, callbacks=[every_3])


def resume(state_dict_type: str) -> None:
    strategy = lightning_gpipe.GPipeStrategy(chunks=3, state_dict_type=state_dict_type)
    path = os.path.join(args.out, f"{state_dict_type}.ckpt")
    run(f"resume_{state_dict_type}_K{args.devices}", strategy, max_steps=6, ckpt_path=path)


if not args.resume_only:
    for name, kwargs in SCENARIOS.items():
        run(name, lightning_gpipe.GPipeStrategy(chunks=3), **kwargs)
    trainer = L.Trainer(strategy=lightning_gpipe.GPipeStrategy(chunks=3), devices=args.devices)
    with trainer.init_module(empty_init=True):
        module = TupleNet()
    run("empty_init", lightning_gpipe.GPipeStrategy(chunks=3), module=module)
    trainer = L.Trainer(strategy=lightning_gpipe.GPipeStrategy(chunks=3), devices=args.devices, **trainer_kwargs())
    L.seed_everything(1, verbose=False)
    metrics = trainer.validate(TupleNet(), loader(seed=1))
    if trainer.global_rank == 0:
        with open(os.path.join(args.out, "validate.json"), "w") as f:
            json.dump(metrics, f)
    for kind in ("full", "sharded"):
        write_checkpoint(kind)
for kind in ("full", "sharded"):
    resume(kind)
