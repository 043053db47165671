"""The translation example's tiny Transformer, shared by tests/unit/test_translation.py,
tests/distributed/test_translation.py, tests/nonchain.py and the workers: its settings, a quiet Trainer, a seeded
fit with its loss curve, and the shipped sentences to translate."""

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "translation"
sys.path.insert(0, str(EXAMPLE.parent))

from translation.data import TranslationDataModule  # noqa: E402
from translation.module import TranslationModule  # noqa: E402

TINY = dict(
    d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64, dropout=0.0, lr=3e-3,
    warmup_steps=5, decode=False,
)  # fmt: skip
"""The example's Transformer, small enough for a test: 7 backbone layers, dropout 0 (deterministic)."""

STEPS = 20
"""Training steps compared between the pipeline and one device."""

DECODINGS = {
    "greedy": dict(beam_size=1, kv_cache=True),
    "greedy_uncached": dict(beam_size=1, kv_cache=False),
    "beam": dict(beam_size=4, kv_cache=True),
}
"""The module's decoding attributes compared between the pipeline and one device."""


def tiny_datamodule(**overrides) -> TranslationDataModule:
    """The shipped subset in small token-bucketed batches (at most 600 padded tokens per side)."""
    return TranslationDataModule(**{"max_tokens": 600, "val_rows": 4, **overrides})


def tiny_trainer(strategy="auto", devices: int = 1, **overrides) -> L.Trainer:
    """A quiet CPU Trainer running :data:`STEPS` steps without validation, clipping gradients at norm 1."""
    kwargs = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, max_steps=STEPS,
        gradient_clip_val=1.0,
    )  # fmt: skip
    return L.Trainer(strategy=strategy, devices=devices, **{**kwargs, **overrides})


class LossCurve(L.Callback):
    """Records ``train_loss`` after every training step (on every rank; relayed from the last stage)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def fit_tiny(strategy="auto", devices: int = 1) -> tuple[TranslationModule, list[float]]:
    """Train a freshly seeded tiny model for :data:`STEPS` steps; return it and its loss curve."""
    L.seed_everything(0, verbose=False)
    module = TranslationModule(**TINY)
    curve = LossCurve()
    tiny_trainer(strategy, devices, callbacks=[curve]).fit(module, tiny_datamodule())
    return module, curve.losses


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread (as each stage process does), which is faster for tiny models on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def validation_sentences(language: str, count: int) -> list[str]:
    """The first ``count`` sentences of ``language`` in the shipped validation subset."""
    with open(EXAMPLE / "data" / "validation.jsonl", encoding="utf-8") as f:
        return [json.loads(line)[language] for line, _ in zip(f, range(count))]


def predict_data(target: str = "de", count: int = 6):
    """Batches of the first ``count`` English validation sentences to translate into ``target``."""
    datamodule = TranslationDataModule(predict_sentences=validation_sentences("en", count), predict_target=target)
    return datamodule.predict_dataloader()
