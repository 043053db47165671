"""Distributed worker: models users bring, as the contract meets them, trained 3 steps on 2 stages.

Usage: python brought_models.py OUT_DIR  (run with Lightning's launcher: --devices=2)
Writes rank 0's state dicts after fit: OUT_DIR/resnet_cut{c}.pt (``InplaceResNet`` with ``balance=[c, 7 - c]``, for
every cut c, the checkpoint modes in turn, 2 micro-batches), OUT_DIR/resnet_time.pt (``balance="time"``) and
OUT_DIR/whole.pt (``KeepsWholeModel``); and OUT_DIR/held_rank{r}.json: the parameters stage r held while training the
whole-model module, and what the model summary says each stage holds.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from contract_models import InplaceResNet, KeepsWholeModel, held_parameters, images  # noqa: E402
from models import loader, trainer_kwargs  # noqa: E402

import lightning_gpipe  # noqa: E402

STEPS = 3
MODES = ("never", "always", "except_last")

out = sys.argv[1]


class Held(L.Callback):
    """Records the parameters this stage holds once training starts."""

    def on_train_start(self, trainer, pl_module):
        self.held = held_parameters(pl_module)


def train(model, data, callbacks=(), **options):
    """Fit a ``model()`` made after seeding for :data:`STEPS` steps on 2 stages; rank 0 gets the whole module back."""
    L.seed_everything(1, verbose=False)
    module = model()
    strategy = lightning_gpipe.GPipeStrategy(chunks=2, **options)
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=STEPS, **trainer_kwargs(callbacks=list(callbacks)))
    trainer.fit(module, data)
    return trainer


for cut in range(1, 7):
    trainer = train(InplaceResNet, images(), balance=[cut, 7 - cut], checkpoint=MODES[cut % 3])
    if trainer.global_rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(out, f"resnet_cut{cut}.pt"))
trainer = train(InplaceResNet, images(), balance="time")
if trainer.global_rank == 0:
    torch.save(trainer.lightning_module.state_dict(), os.path.join(out, "resnet_time.pt"))
held, summary = Held(), lightning_gpipe.PipelineModelSummary()
trainer = train(KeepsWholeModel, loader(rows=24, batch_size=8), callbacks=[held, summary], balance=[2, 3])
rank = trainer.global_rank
if rank == 0:
    torch.save(trainer.lightning_module.state_dict(), os.path.join(out, "whole.pt"))
with open(os.path.join(out, f"held_rank{rank}.json"), "w") as f:
    json.dump({"held": held.held, "summary": [stage.parameters for stage in summary.stages]}, f)
