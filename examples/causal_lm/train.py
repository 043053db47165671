"""Fine-tune a causal LM from `transformers` with GPipe pipeline parallelism (LightningCLI).

Usage (from the repository root)::

    python examples/causal_lm/train.py fit
    python examples/causal_lm/train.py fit --trainer.max_steps=20 --trainer.devices=2
    python examples/causal_lm/train.py fit --config examples/causal_lm/configs/cpu.yaml
    python examples/causal_lm/train.py fit --config examples/causal_lm/configs/qwen3.yaml  # another family
    python examples/causal_lm/train.py fit --model.pretrained=PATH/OR/HUB/NAME   # a pretrained checkpoint
    python examples/causal_lm/train.py fit --model.pretrained=causal_lm_model --model.lora=true  # LoRA adapters
    python examples/causal_lm/train.py fit --save_pretrained.dirpath=runs/my_model
    python examples/causal_lm/train.py fit --data.packing=true --data.max_tokens=2048  # packed rows, a token budget

Defaults (``configs/cpu.yaml`` writes them out): a new Llama-architecture model built from a config (hidden size
256, 4 blocks, the translation example's 8,000-token BPE tokenizer, tied embeddings, ~5M parameters), trained on
the translation example's shipped Multi30k sentences (en, de, fr, cs) as monolingual text, ``strategy="gpipe"`` on 2
CPU processes, 200 steps of 32 sentences, AdamW (lr 1e-3, 20 warmup steps, cosine decay), validation loss every 50
steps, CSV logs under ``<default_root_dir>/lightning_logs/causal_lm/version_N/``, and after fit a directory that
``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load (``--save_pretrained.dirpath``,
default ``<default_root_dir>/causal_lm_model``: ``default_root_dir`` is the working directory unless
``--trainer.default_root_dir`` is given), each stage writing its own shard. ``--data.packing=true
--data.max_tokens=2048`` packs the sentences into rows of ``--data.max_length`` tokens (no padding, attention inside
each sentence) under a token budget per batch.

``--model.pretrained`` (a local ``save_pretrained`` directory, or a Hub name on a machine that reaches the Hub)
replaces the model config by the checkpoint's and, unless ``--data.tokenizer`` is given, the tokenizer by the
checkpoint's; each stage reads only its own layers' tensors from the checkpoint's safetensors files. A config file
with another ``model.config`` (``configs/qwen3.yaml``) trains another family; ``--model.lora=true`` trains LoRA
adapters (``peft``) on the frozen model instead of every weight, and writes the adapter directory.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from example_cli import DEFAULT_ROOT_DIR, ExampleCLI
from lightning.pytorch.cli import LightningArgumentParser

import lightning_gpipe  # noqa: F401  (registers the "gpipe" strategy)
from causal_lm.data import TextDataModule
from lightning_gpipe.hf import CausalLM, SavePretrained

TRAINER_DEFAULTS = {
    "strategy": "gpipe",
    "accelerator": "cpu",
    "devices": 2,
    "max_epochs": None,
    "max_steps": 200,
    "val_check_interval": 50,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": f"{DEFAULT_ROOT_DIR}/lightning_logs", "name": "causal_lm"},
    },
}
"""Trainer settings used unless overridden by ``--trainer.*`` or a config file."""

MODEL_DEFAULTS = {
    "config": {
        "model_type": "llama",
        "vocab_size": 8000,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "bos_token_id": 2,
        "eos_token_id": 3,
    },
    "lr": 1e-3,
    "warmup_steps": 20,
    "weight_decay": 0.1,
}
"""The model used unless ``--model.*`` or a config file says otherwise: a small Llama over the shipped tokenizer."""


class CausalLMCLI(ExampleCLI):
    """LightningCLI whose ``--model.pretrained`` also chooses the tokenizer (unless ``--data.tokenizer`` is given),
    and whose ``--save_pretrained.dirpath`` says where the fitted model is written for ``from_pretrained``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Model defaults; the ``SavePretrained`` callback's options."""
        super().add_arguments_to_parser(parser)
        parser.set_defaults({f"model.{key}": value for key, value in MODEL_DEFAULTS.items()})
        parser.add_lightning_class_args(SavePretrained, "save_pretrained")
        parser.set_defaults({"save_pretrained.dirpath": f"{DEFAULT_ROOT_DIR}/causal_lm_model"})

    def before_instantiate_classes(self) -> None:
        """The checkpoint's tokenizer for a pretrained model, unless one is named; the fitted model's directory under
        ``--trainer.default_root_dir`` where ``--save_pretrained.dirpath`` starts with ``<default_root_dir>`` (as the
        logs)."""
        super().before_instantiate_classes()
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.model.pretrained is not None and config.data.tokenizer is None:
            config.data.tokenizer = config.model.pretrained
        dirpath = str(config.save_pretrained.dirpath)
        if dirpath.startswith(DEFAULT_ROOT_DIR):
            root = config.trainer.default_root_dir or os.getcwd()
            config.save_pretrained.dirpath = os.path.join(root, dirpath[len(DEFAULT_ROOT_DIR) :].lstrip("/\\"))


def main(args: list[str] | None = None, run: bool = True) -> CausalLMCLI:
    """Parse the command line (or ``args``) and run the chosen LightningCLI subcommand.

    Args:
        args: the arguments to parse instead of ``sys.argv[1:]``.
        run: run a subcommand (``fit``, ``validate``...); with ``False`` only build the model, data and Trainer.

    Returns:
        The CLI, with the ``model``, ``datamodule`` and ``trainer`` it built.
    """
    return CausalLMCLI(
        CausalLM,
        TextDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
