"""What every translation module of the example shares: validation loss, perplexity and SacreBLEU per direction.

:class:`Translator` is the base class of the example's own Transformer (``module.TranslationModule``) and of a Hugging
Face encoder-decoder (``seq2seq.Seq2SeqTranslation``), and the class ``train.py``'s ``--model`` chooses among: both
are scored by the same code, on the same batches of ``data.TranslationDataModule``, so their BLEU compares.
"""

from typing import Any

import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity, SacreBLEUScore

from translation.data import DIRECTIONS


class Translator(LightningModule):
    """A translation module scored per direction: validation decodes the batch (if ``decode``) and logs its corpus
    SacreBLEU per direction, ``val_loss`` and ``val_ppl``; ``predict`` returns the translations.

    A subclass sets ``tokenizer``, ``pad_id`` (the padding id of the batches) and ``decode`` (whether validation
    decodes) in ``__init__``, calls :meth:`add_metrics`, and implements :meth:`target_logits` and
    :meth:`translate_batch`.

    Logged: ``val_loss`` (cross-entropy per target token, no smoothing), ``val_ppl``, ``val_bleu_<src>_<tgt>``
    (SacreBLEU, 0-100, 13a tokenization, cased, of the detokenized translations against the raw references).
    """

    tokenizer: Any
    pad_id: int
    decode: bool

    def add_metrics(self) -> None:
        """Create the validation metrics (metrics rather than tensors at epoch level: exact over several pipeline
        replicas, and no warning with one)."""
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity(ignore_index=self.pad_id)
        self.val_bleu = nn.ModuleDict({_key(direction): SacreBLEUScore() for direction in DIRECTIONS})
        self.val_bleu_percent = nn.ModuleDict({key: bleu * 100 for key, bleu in self.val_bleu.items()})

    def target_logits(self, batch: dict) -> Tensor:
        """The ``(N, T, vocab)`` logits of ``batch["tgt_out"]``'s tokens, through the backbone (the subclass's)."""
        raise NotImplementedError

    def translate_batch(self, batch: dict) -> list[str]:
        """The detokenized translations of ``batch["src"]`` into each row's target language (the subclass's)."""
        raise NotImplementedError

    def cross_entropy(self, logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """Mean cross-entropy over the non-padding target tokens of ``(N, T, vocab)`` logits and ``(N, T)`` targets."""
        return F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=self.pad_id, label_smoothing=label_smoothing
        )

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Translate the batch (if ``decode``) and score BLEU per direction, then log loss and perplexity."""
        if self.decode:
            hypotheses = self.translate_batch(batch)
            for direction in set(batch["directions"]):
                rows = [i for i, d in enumerate(batch["directions"]) if d == direction]
                self.val_bleu[_key(direction)].update(
                    [hypotheses[i] for i in rows], [[batch["references"][i]] for i in rows]
                )
        logits = self.target_logits(batch)
        tokens = int((batch["tgt_out"] != self.pad_id).sum())
        self.val_loss(self.cross_entropy(logits, batch["tgt_out"]), weight=tokens)
        self.log("val_loss", self.val_loss, prog_bar=True)
        self.val_ppl(logits, batch["tgt_out"])
        self.log("val_ppl", self.val_ppl)

    def on_validation_epoch_end(self) -> None:
        """Log the corpus SacreBLEU (0-100) of every direction that was decoded; Lightning then resets the scores."""
        for key, bleu in self.val_bleu.items():
            if bleu.update_count:
                self.log(f"val_bleu_{key}", self.val_bleu_percent[key], prog_bar=key in ("en_de", "de_en"))

    def predict_step(self, batch: dict, batch_idx: int) -> list[str]:
        """Translate ``batch["src"]`` through the pipeline (see :meth:`translate_batch`)."""
        return self.translate_batch(batch)


def _key(direction: str) -> str:
    """``"en-de"`` -> ``"en_de"`` (module and metric names cannot hold ``-``)."""
    return direction.replace("-", "_")
