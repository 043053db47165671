"""Fine-tune a timm model with GPipe pipeline parallelism on this example's CIFAR-10 data (LightningCLI).

The model is ``lightning_gpipe.timm.ImageClassifier``: any timm model of the families ``lightning_gpipe.timm`` cuts
(ViT, DeiT, BEiT, EVA, Swin, ConvNeXt, ResNet/ResNeXt, EfficientNet, RegNet, MLP-Mixer), by name, split into stages
without a wrapper. Data, augmentation and Trainer defaults are ``train.py``'s (the shipped subset, batch 32, 2 CPU
stage processes, 20 steps); logs go to ``<default_root_dir>/lightning_logs/timm/version_N/``.

Usage (from the repository root, after ``pip install torch==2.13.0 -e ".[examples,timm]"``; beside the CPU build of
torch, torchvision's CPU build too: ``pip install torchvision==0.28.0 --index-url
https://download.pytorch.org/whl/cpu``)::

    python examples/amoebanet/train_timm.py fit                                  # a ResNet-18 for 10 classes
    python examples/amoebanet/train_timm.py fit --model.model=convnext_atto --model.optimizer=adamw --model.lr=1e-3
    python examples/amoebanet/train_timm.py fit --model.model=vit_tiny_patch16_224 \\
        --model.model_kwargs='{"img_size": 32, "patch_size": 4}' --model.optimizer=adamw --model.lr=1e-3
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from example_cli import DEFAULT_ROOT_DIR, ExampleCLI, run_cli

from amoebanet.data import CIFAR10DataModule
from amoebanet.train import TRAINER_DEFAULTS as AMOEBANET_DEFAULTS
from lightning_gpipe.timm import ImageClassifier

LOGGER = {"save_dir": f"{DEFAULT_ROOT_DIR}/lightning_logs", "name": "timm"}
TRAINER_DEFAULTS = {**AMOEBANET_DEFAULTS, "logger": {**AMOEBANET_DEFAULTS["logger"], "init_args": LOGGER}}
"""``train.py``'s Trainer settings, the CSV logs under ``timm/``."""


def main(args: list[str] | None = None, run: bool = True) -> ExampleCLI:
    """Parse the command line (or ``args``) and run the chosen subcommand (see ``train.main``)."""
    return ExampleCLI(
        ImageClassifier,
        CIFAR10DataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    run_cli(main)
