"""What the translation example adds to the Trainer: counting tokens for the throughput, printing translations."""

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


def batch_tokens(batch: dict) -> int:
    """Non-padding source and target tokens of a ``TranslationDataModule`` batch (the target with its ``</s>``).

    The ``length_fn`` of ``lightning_gpipe.callbacks.PipelineThroughput``, which then logs
    ``throughput/device/items_per_sec``: tokens per second of the pipeline. Padding is id 0.
    """
    tokens = int((batch["src"] != 0).sum())
    if "tgt_out" in batch:
        tokens += int((batch["tgt_out"] != 0).sum())
    return tokens


class PrintTranslations(Callback):
    """Print each prediction batch's translations, one per line, on global rank 0 (``train.py predict``)."""

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        """Print ``outputs``, the list of translated sentences of the batch."""
        if trainer.is_global_zero:
            for sentence in outputs:
                print(sentence, flush=True)
