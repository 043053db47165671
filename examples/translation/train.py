"""Train the multilingual Transformer with GPipe pipeline parallelism from the command line (LightningCLI).

Usage (from the repository root)::

    python examples/translation/train.py fit
    python examples/translation/train.py fit --trainer.max_steps=20 --trainer.devices=2
    python examples/translation/train.py fit --config examples/translation/configs/multi30k_30min.yaml
    python examples/translation/train.py fit --data.data_dir=PATH/TO/multi30k
    python examples/translation/train.py fit --trainer.default_root_dir=runs/first
    python examples/translation/train.py predict --ckpt_path=PATH.ckpt \\
        --data.predict_sentences='["A dog runs on the beach."]' --data.predict_target=de
    python examples/translation/train.py predict --ckpt_path=PATH.ckpt --data.predict_file=sentences.en \\
        --data.predict_target=de --translations.output_file=sentences.de --model.beam_size=4
    python examples/translation/train.py validate --ckpt_path=PATH.ckpt --data.data_dir=PATH/TO/multi30k \\
        --data.val_split=test_2016_flickr --data.val_rows=null --data.val_directions=[en-de]
    python examples/translation/train.py fit --model=examples/translation/configs/seq2seq_t5.yaml  # a T5 config
    python examples/translation/train.py fit --model=Seq2SeqTranslation --model.config=bart   # BART's default sizes
    python examples/translation/train.py fit --model=Seq2SeqTranslation --model.pretrained=PATH/TO/nllb-200 \\
        --model.lr=1e-4 --data.train_directions=[en-de]

Defaults (``configs/cpu.yaml`` writes them out): a pre-LayerNorm Transformer
(d_model 256, 3 + 3 layers) for the six directions en<->de, en<->fr, en<->cs of
the shipped Multi30k subset, batches of up to 4,096 tokens per side,
``strategy="gpipe"`` on 2 CPU processes, 20 steps, validation (loss,
perplexity, SacreBLEU per direction) every 20 steps on 50 rows, token
throughput and pipeline bubble (``PipelineThroughput``), CSV logs and
checkpoints under ``<default_root_dir>/lightning_logs/translation/version_N/``
(``default_root_dir``: the working directory unless ``--trainer.default_root_dir``
is given; a ``--trainer.logger.save_dir`` of your own replaces
``<default_root_dir>/lightning_logs``).

``--model`` chooses the module (LightningCLI's subclass mode; without it, the example's own
``TranslationModule``): ``--model=Seq2SeqTranslation`` (``seq2seq.py``) trains a Hugging Face encoder-decoder
instead, from a pretrained directory (``--model.pretrained``, with the tokenizer it ships) or from a config
(``--model.config``: a dict, a JSON file or a model type) with the shipped tokenizer, on the same batches, in the
model's language convention (``conventions.py``; the CLI sets ``--data.model_type`` and, for a pretrained model,
``--data.tokenizer_file``), scored by the same SacreBLEU.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from example_cli import DEFAULT_ROOT_DIR, ExampleCLI, run_cli
from lightning.pytorch.cli import LightningArgumentParser

import lightning_gpipe  # noqa: F401  (registers the "gpipe" strategy)
from lightning_gpipe.lightning.callbacks import PipelineThroughput
from translation.callbacks import WriteTranslations, batch_tokens
from translation.data import TranslationDataModule
from translation.module import TranslationModule
from translation.scoring import Translator
from translation.seq2seq import Seq2SeqTranslation, model_type_of

TRAINER_DEFAULTS = {
    "strategy": "gpipe",
    "accelerator": "cpu",
    "devices": 2,
    "max_epochs": None,
    "max_steps": 20,
    "val_check_interval": 20,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 5,
    "gradient_clip_val": 1.0,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": f"{DEFAULT_ROOT_DIR}/lightning_logs", "name": "translation"},
    },
}
"""Trainer settings used unless overridden by ``--trainer.*`` or a config file. The logger's ``save_dir`` starts
at the Trainer's ``default_root_dir`` (see ``example_cli.py``)."""

CALLBACKS = {"callbacks": [PipelineThroughput(length_fn=batch_tokens)]}
"""Callbacks added to every run, besides those of ``--trainer.callbacks``: tokens per second, pipeline bubble
and stage efficiency (logged every ``log_every_n_steps``)."""


class TranslationCLI(ExampleCLI):
    """LightningCLI whose ``--model`` is a :class:`~translation.scoring.Translator` (``TranslationModule`` unless
    given), whose ``--data.tokenizer_file`` also sets the model's vocabulary, and whose ``--translations.output_file``
    says where ``predict`` writes (standard output by default)."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """The default model class; link the data module's tokenizer file to the model's; add the
        ``WriteTranslations`` callback's options."""
        super().add_arguments_to_parser(parser)
        parser.set_defaults({"model": {"class_path": f"{TranslationModule.__module__}.TranslationModule"}})
        parser.link_arguments("data.tokenizer_file", "model.init_args.tokenizer_file")
        parser.add_lightning_class_args(WriteTranslations, "translations")

    def before_instantiate_classes(self) -> None:
        """For a :class:`~translation.seq2seq.Seq2SeqTranslation`, batches in its model's language convention
        (``--data.model_type``) and, from a pretrained directory without ``--data.tokenizer_file``, with its
        tokenizer."""
        super().before_instantiate_classes()
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.model.class_path == f"{Seq2SeqTranslation.__module__}.Seq2SeqTranslation":
            model = config.model.init_args
            if model.pretrained is not None and config.data.tokenizer_file is None:
                config.data.tokenizer_file = model.pretrained
            config.data.model_type = model_type_of(model.pretrained, model.config)


def main(args: list[str] | None = None, run: bool = True) -> TranslationCLI:
    """Parse the command line (or ``args``) and run the chosen LightningCLI subcommand.

    Args:
        args: the arguments to parse instead of ``sys.argv[1:]``.
        run: run a subcommand (``fit``, ``predict``, ...); with ``False`` only build the model, data and
            Trainer from ``args`` (no subcommand then).

    Returns:
        The CLI, with the ``model``, ``datamodule`` and ``trainer`` it built.
    """
    return TranslationCLI(
        Translator,
        TranslationDataModule,
        subclass_mode_model=True,
        trainer_defaults={**TRAINER_DEFAULTS, **CALLBACKS},
        seed_everything_default=0,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    run_cli(main)
