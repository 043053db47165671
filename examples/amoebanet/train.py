"""Train AmoebaNet-D with GPipe pipeline parallelism from the command line (LightningCLI).

Usage (from the repository root)::

    python examples/amoebanet/train.py fit
    python examples/amoebanet/train.py fit --trainer.max_steps=100 --data.batch_size=64
    python examples/amoebanet/train.py fit --config examples/amoebanet/configs/amoebanet_d_18_208.yaml
    python examples/amoebanet/train.py fit --trainer.strategy=auto --trainer.devices=1

Defaults (``configs/cpu.yaml`` writes them out): AmoebaNet-D (6, 16) on the
shipped CIFAR-10 subset, batch 32, ``strategy="gpipe"`` on 2 CPU processes,
20 steps, validation every 20 steps, CSV logs and checkpoints under
``lightning_logs/amoebanet/version_N/``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning.pytorch.cli import LightningCLI

import lightning_gpipe  # noqa: F401  (registers the "gpipe" strategy)
from amoebanet.data import CIFAR10DataModule
from amoebanet.module import AmoebaNetClassifier

TRAINER_DEFAULTS = {
    "strategy": "gpipe",
    "accelerator": "cpu",
    "devices": 2,
    "max_epochs": None,
    "max_steps": 20,
    "val_check_interval": 20,
    "check_val_every_n_epoch": None,
    "log_every_n_steps": 5,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "lightning_logs", "name": "amoebanet"},
    },
}
"""Trainer settings used unless overridden by ``--trainer.*`` or a config file."""


def main() -> None:
    """Parse the command line and run the chosen LightningCLI subcommand."""
    LightningCLI(
        AmoebaNetClassifier,
        CIFAR10DataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
    )


if __name__ == "__main__":
    main()
