"""The LightningCLI the three examples use: a logger's ``save_dir`` may start at the Trainer's ``default_root_dir``.

Lightning's own default logger writes under ``default_root_dir``, but a logger given in a config (``CSVLogger``
here) needs a ``save_dir`` of its own, so ``--trainer.default_root_dir=DIR`` alone would not move the logs. The
examples' loggers therefore say ``save_dir: <default_root_dir>/lightning_logs``: :data:`DEFAULT_ROOT_DIR` at the
start of any logger's ``save_dir`` is replaced with ``--trainer.default_root_dir`` (the working directory when it
is not given) before the Trainer is built, so metrics and checkpoints go to ``DIR/lightning_logs/<name>/version_N``.
A ``save_dir`` without it (``--trainer.logger.save_dir=logs``) is used as it is.

Before ``fit``, ``validate``, ``test`` and ``predict`` the CLI calls the data module's ``check_data(subcommand)``, so
that a missing ``--data.data_dir`` or an unreachable Hub dataset stops the command at once, in the one process that
exists then, instead of after the Trainer has started the other stage processes; :func:`run_cli` prints that error's
message alone (no traceback) and exits with status 1.

``--precision_fallback=true`` (a CPU recipe's config sets it) trains in ``32-true`` where the config asks for bf16
mixed precision on a CPU that runs bf16 slower than fp32, as measured before the Trainer is built
(:mod:`cpu_precision`).
"""

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from cpu_precision import cpu_precision
from example_data import DataUnavailableError
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

DEFAULT_ROOT_DIR = "<default_root_dir>"
"""Stands for ``trainer.default_root_dir`` at the start of a logger's ``save_dir``."""

# Lightning 2.6 builds torch.utils._pytree.LeafSpec, which torch 2.13 deprecates: a FutureWarning from inside
# Lightning, once per process, that the user cannot act on (the pins in pyproject.toml are this pair).
warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)


class StepProgressBar(RichProgressBar):
    """Lightning's ``RichProgressBar`` without its "Epoch 0/-2": a run bounded by ``max_steps`` alone has
    ``max_epochs=-1``, which the bar prints as the last epoch, ``-1 - 1``; this one then prints ``Epoch 0``, as
    Lightning's ``TQDMProgressBar`` does."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs != -1:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        return f"{description:{len(self.validation_description)}}"  # as wide as "Validation", as Lightning pads it


def follow_default_root_dir(config: Any) -> None:
    """Replace :data:`DEFAULT_ROOT_DIR` at the start of each logger's ``save_dir`` in a parsed ``config``.

    Args:
        config: the parsed configuration of one subcommand (a ``jsonargparse.Namespace`` with a ``trainer``
            entry); changed in place. Loggers given as ``true``, ``false`` or without ``save_dir`` are left alone.
    """
    trainer = config.trainer
    root = trainer.default_root_dir or os.getcwd()
    loggers = trainer.logger if isinstance(trainer.logger, list) else [trainer.logger]
    for logger in loggers:
        init_args = getattr(logger, "init_args", None)
        save_dir = getattr(init_args, "save_dir", None)
        if isinstance(save_dir, str) and save_dir.startswith(DEFAULT_ROOT_DIR):
            rest = save_dir[len(DEFAULT_ROOT_DIR) :].lstrip("/\\")
            init_args.save_dir = os.path.join(root, rest) if rest else root


def fall_back_to_fp32(config: Any) -> None:
    """With ``precision_fallback`` set and a CPU accelerator, replace a bf16 mixed ``trainer.precision`` by
    ``32-true`` where this CPU runs bf16 slower (:func:`cpu_precision.cpu_precision`), printing what it measured.

    Args:
        config: the parsed configuration of one subcommand; changed in place.
    """
    trainer = config.trainer
    if not config.precision_fallback or trainer.accelerator != "cpu" or not isinstance(trainer.precision, str):
        return
    trainer.precision, line = cpu_precision(trainer.precision)
    if line is not None:
        print(line, flush=True)


class ExampleCLI(LightningCLI):
    """``LightningCLI`` whose loggers' ``save_dir`` may start with :data:`DEFAULT_ROOT_DIR`, which checks the data
    (the data module's ``check_data``) before a subcommand starts any stage process, whose default progress bar
    is :class:`StepProgressBar`, and whose ``--precision_fallback`` trains a CPU recipe in fp32 where bf16 is
    slower (:func:`fall_back_to_fp32`)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``--precision_fallback`` (default ``false``)."""
        parser.add_argument(
            "--precision_fallback",
            type=bool,
            default=False,
            help="on a CPU, train in 32-true where the config's bf16 mixed precision measures slower than fp32",
        )

    def before_instantiate_classes(self) -> None:
        """Resolve :data:`DEFAULT_ROOT_DIR` in the loggers' ``save_dir`` and apply ``--precision_fallback`` before
        the Trainer is built."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        follow_default_root_dir(config)
        fall_back_to_fp32(config)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Lightning's Trainer, with :class:`StepProgressBar` in place of the ``RichProgressBar`` Lightning adds when
        no progress bar is configured."""
        trainer = super().instantiate_trainer(**kwargs)
        for index, callback in enumerate(trainer.callbacks):
            if type(callback) is RichProgressBar:
                trainer.callbacks[index] = StepProgressBar()
        return trainer

    def check_data(self) -> None:
        """Call the data module's ``check_data(subcommand)``, if it has one."""
        check = getattr(self.datamodule, "check_data", None)
        if check is not None:
            check(self.subcommand)

    def before_fit(self) -> None:
        """Check the data before ``fit`` starts any stage process."""
        self.check_data()

    def before_validate(self) -> None:
        """Check the data before ``validate`` starts any stage process."""
        self.check_data()

    def before_test(self) -> None:
        """Check the data before ``test`` starts any stage process."""
        self.check_data()

    def before_predict(self) -> None:
        """Check the data before ``predict`` starts any stage process."""
        self.check_data()


def run_cli(main: Callable[[], Any]) -> None:
    """Run an example's ``main()``; on :class:`~example_data.DataUnavailableError`, print its message and exit 1."""
    try:
        main()
    except DataUnavailableError as error:
        sys.exit(f"error: {error}")
