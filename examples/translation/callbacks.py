"""What the translation example adds to the Trainer: counting tokens for the throughput, writing translations."""

from typing import Any, TextIO

from lightning.pytorch import Callback, LightningModule, Trainer


def batch_tokens(batch: dict) -> int:
    """Non-padding source and target tokens of a ``TranslationDataModule`` batch (the target with its ``</s>``).

    The ``length_fn`` of ``lightning_gpipe.lightning.callbacks.PipelineThroughput``, which then logs
    ``throughput/device/items_per_sec``: tokens per second of the pipeline. Padding is id 0.
    """
    tokens = int((batch["src"] != 0).sum())
    if "tgt_out" in batch:
        tokens += int((batch["tgt_out"] != 0).sum())
    return tokens


class WriteTranslations(Callback):
    """Write each prediction batch's translations, one per line in the input's order, on global rank 0
    (``train.py predict``).

    Args:
        output_file: the UTF-8 text file to write (replaced if it exists); ``None`` (default) prints to
            standard output.
    """

    def __init__(self, output_file: str | None = None) -> None:
        self.output_file = output_file
        self._out: TextIO | None = None

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Open ``output_file`` on global rank 0."""
        if trainer.is_global_zero and self.output_file is not None:
            self._out = open(self.output_file, "w", encoding="utf-8")

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        """Write ``outputs``, the list of translated sentences of the batch."""
        if trainer.is_global_zero:
            for sentence in outputs:
                print(sentence, file=self._out, flush=self._out is None)

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Close ``output_file``."""
        if self._out is not None:
            self._out.close()
            self._out = None
