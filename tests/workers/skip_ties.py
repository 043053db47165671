"""Distributed worker: skip connections and tied parameters on K = 3 stages, every configuration in one launch.

Usage: python skip_ties.py OUT_DIR --devices=3  (run with Lightning's launcher)
Writes, from rank 0 after each fit (the full state dict), OUT_DIR/{name}.pt for
- SkipNet (``balance=[2, 2, 2]``: "skip" goes from stage 0 to stage 2) with every checkpoint mode, deferred weight
  gradients and ``schedule="1f1b"``, with ``balance=[3, 2, 1]`` (a skip to the neighbouring stage too), and
  interleaved (``virtual_stages=2``, one layer per virtual stage) and under ZB-V (the skips within a stage):
  skip_*.pt; its predictions on every rank: skip_predictions_rank{r}.pt;
- TiedNet (``balance=[3, 2, 2]``: the embedding on stage 0 tied to the head on stage 2, one Linear on stages 0
  and 2) under fill-drain, 1F1B, clipping by norm, looped fill-drain with 2 chunks per stage and ZB-V: tied_*.pt;
  whether rank 0's module is tied again after fit: tied_again.txt; a full checkpoint written at the end of the
  first tied run: tied.ckpt;
- the translation example with tied tables (``fit_tied_translation``): translation.pt; its greedy translations
  through the pipeline on every rank: translations_rank{r}.pt;
and OUT_DIR/receives_rank{r}.pt: every point-to-point receive (source, tag, shape) each rank posted during the
first SkipNet run.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from models import trainer_kwargs  # noqa: E402
from nonchain import SkipNet, TiedNet, fit_nonchain, fit_tied_translation, skip_loader  # noqa: E402
from tiny_translation import predict_data, tiny_trainer  # noqa: E402

import lightning_gpipe  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--devices", type=int, required=True)
args = parser.parse_args()


class SaveAtEnd(Callback):
    def on_train_end(self, trainer, pl_module):
        trainer.save_checkpoint(os.path.join(args.out, "tied.ckpt"))


receives, irecv = [], dist.irecv


def recording_irecv(tensor, src=None, *rest, **kwargs):
    receives.append((src, kwargs.get("tag", 0), tuple(tensor.shape)))
    return irecv(tensor, src, *rest, **kwargs)


skip_configs = {
    "skip_always": dict(chunks=3, checkpoint="always"),
    "skip_except_last_deferred": dict(chunks=3, checkpoint="except_last", defer_weight_grad=True),
    "skip_1f1b_never": dict(chunks=4, checkpoint="never", schedule="1f1b"),
    "skip_1f1b_always": dict(chunks=4, checkpoint="always", schedule="1f1b"),
    "skip_zb_h1_always": dict(chunks=4, checkpoint="always", schedule="zb-h1"),
    # 2 model chunks per stage, one layer each: "skip" from stage 0 chunk 0 to stage 2 chunk 1, the inner one from
    # stage 2 chunk 0 to stage 0 chunk 1
    "skip_interleaved_1f1b": dict(chunks=4, checkpoint="always", schedule="1f1b", virtual_stages=2, balance=[1] * 6),
    # ZB-V, one layer per virtual stage: both skips join two chunks of one stage (0 and 5 on stage 0, 2 and 3 on
    # stage 2), through the process's turns
    "skip_zb_v": dict(chunks=4, checkpoint="always", schedule="zb-v", balance=[1] * 6),
    # the inner "skip" from stage 0 to its neighbour, beside the activation; the outer one from stage 0 to 2
    # (last: its module is the one that predicts below)
    "skip_neighbour_1f1b": dict(chunks=3, checkpoint="except_last", schedule="1f1b", balance=[3, 2, 1]),
}
for i, (name, config) in enumerate(skip_configs.items()):
    dist.irecv = recording_irecv if i == 0 else irecv
    strategy = lightning_gpipe.GPipeStrategy(**{"balance": [2, 2, 2], **config})
    trainer = fit_nonchain(SkipNet, strategy=strategy, devices=args.devices)
    rank = strategy.global_rank
    if i == 0:
        torch.save(receives, os.path.join(args.out, f"receives_rank{rank}.pt"))
    if rank == 0:
        torch.save(trainer.lightning_module.state_dict(), os.path.join(args.out, f"{name}.pt"))
dist.irecv = irecv
module = trainer.lightning_module
predictor = L.Trainer(
    strategy=lightning_gpipe.GPipeStrategy(balance=[3, 2, 1], chunks=3), devices=args.devices, **trainer_kwargs()
)
torch.save(predictor.predict(module, skip_loader()), os.path.join(args.out, f"skip_predictions_rank{rank}.pt"))

tied_configs = {
    "tied_except_last": (dict(chunks=3, checkpoint="except_last"), dict(callbacks=[SaveAtEnd()])),
    "tied_1f1b": (dict(chunks=3, checkpoint="never", schedule="1f1b"), {}),
    "tied_zb_h1": (dict(chunks=3, checkpoint="never", schedule="zb-h1"), {}),
    "tied_clipped": (dict(chunks=3, checkpoint="always"), dict(gradient_clip_val=0.05)),
    # looped fill-drain, 2 model chunks per stage: the shared Linear on stage 0 chunk 0 and stage 1 chunk 1
    "tied_interleaved_gpipe": (dict(chunks=3, checkpoint="never", virtual_stages=2, balance=[2, 1, 1, 1, 1, 1]), {}),
    # ZB-V: the embedding and the head both on stage 0 (one object there), the shared Linear on stages 0 and 1
    "tied_zb_v": (dict(chunks=3, checkpoint="never", schedule="zb-v", balance=[2, 1, 1, 1, 1, 1]), {}),
}
for name, (config, fit_args) in tied_configs.items():
    strategy = lightning_gpipe.GPipeStrategy(**{"balance": [3, 2, 2], **config})
    module = fit_nonchain(TiedNet, strategy=strategy, devices=args.devices, **fit_args).lightning_module
    if strategy.global_rank == 0:
        torch.save(module.state_dict(), os.path.join(args.out, f"{name}.pt"))
        tied = module.head.weight is module.backbone[0].weight and module.backbone[1] is module.backbone[5]
        with open(os.path.join(args.out, "tied_again.txt"), "w") as f:
            f.write(str(tied))

translation = fit_tied_translation(lightning_gpipe.GPipeStrategy(chunks=3), args.devices)
if rank == 0:
    torch.save(translation.state_dict(), os.path.join(args.out, "translation.pt"))
decoder = tiny_trainer(lightning_gpipe.GPipeStrategy(chunks=2), args.devices)
torch.save(decoder.predict(translation, predict_data()), os.path.join(args.out, f"translations_rank{rank}.pt"))
