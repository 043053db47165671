"""Train AmoebaNet-D with GPipe pipeline parallelism from the command line (LightningCLI).

Usage (from the repository root)::

    python examples/amoebanet/train.py fit
    python examples/amoebanet/train.py fit --trainer.max_steps=100 --data.batch_size=64
    python examples/amoebanet/train.py fit --config examples/amoebanet/configs/amoebanet_d_18_208.yaml
    python examples/amoebanet/train.py fit --trainer.strategy=auto --trainer.devices=1
    python examples/amoebanet/train.py fit --trainer.default_root_dir=runs/first

Defaults (``configs/cpu.yaml`` writes them out): AmoebaNet-D (6, 16) on the
shipped CIFAR-10 subset, batch 32, ``strategy="gpipe"`` on 2 CPU processes,
20 steps, validation every 20 steps, CSV logs and checkpoints under
``<default_root_dir>/lightning_logs/amoebanet/version_N/`` (``default_root_dir``:
the working directory unless ``--trainer.default_root_dir`` is given; a
``--trainer.logger.save_dir`` of your own replaces ``<default_root_dir>/lightning_logs``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from example_cli import DEFAULT_ROOT_DIR, ExampleCLI, run_cli

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
        "init_args": {"save_dir": f"{DEFAULT_ROOT_DIR}/lightning_logs", "name": "amoebanet"},
    },
}
"""Trainer settings used unless overridden by ``--trainer.*`` or a config file. The logger's ``save_dir`` starts
at the Trainer's ``default_root_dir`` (see ``example_cli.py``)."""


def main(args: list[str] | None = None, run: bool = True) -> ExampleCLI:
    """Parse the command line (or ``args``) and run the chosen LightningCLI subcommand.

    Args:
        args: the arguments to parse instead of ``sys.argv[1:]``.
        run: run a subcommand (``fit``, ``validate``, ...); with ``False`` only build the model, data and
            Trainer from ``args`` (no subcommand then).

    Returns:
        The CLI, with the ``model``, ``datamodule`` and ``trainer`` it built.
    """
    return ExampleCLI(
        AmoebaNetClassifier,
        CIFAR10DataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    run_cli(main)
