"""Real text for causal-LM fine-tuning, shipped in the repository: the translation example's Multi30k sentences.

The default reads ``examples/translation/data/{train,validation}.jsonl`` in place (3,000 and 200 rows, each a
sentence in English, German, French and Czech; see that directory's README for the source and licence) and
tokenizes with ``examples/translation/tokenizer.json`` (BPE, 8,000 tokens, ``<pad>`` 0, ``<s>`` 2, ``</s>`` 3). Every
sentence of every chosen language is one training example, ``<s> sentence </s>``; batches are padded on the right,
with label ``-100`` on padding.
"""

import json
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

TRANSLATION = Path(__file__).resolve().parents[1] / "translation"
"""The translation example, whose data and tokenizer this example reads."""


def load_tokenizer(tokenizer: str | None = None):
    """A ``transformers`` tokenizer: ``None`` the translation example's ``tokenizer.json``; a ``.json`` file a
    ``tokenizers`` file; anything else (a checkpoint directory or Hub name) ``AutoTokenizer.from_pretrained``. A
    tokenizer without a padding token pads with its end-of-sequence token."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer is None or tokenizer.endswith(".json"):
        path = tokenizer or str(TRANSLATION / "tokenizer.json")
        result = PreTrainedTokenizerFast(
            tokenizer_file=path, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
        )
    else:
        result = AutoTokenizer.from_pretrained(tokenizer)
    if result.pad_token is None:
        result.pad_token = result.eos_token
    return result


class TextDataModule(L.LightningDataModule):
    """Sentences of JSON Lines files as causal-LM batches (``input_ids``, ``attention_mask``, ``labels``).

    Args:
        data_dir: a directory with ``{train_split}.jsonl`` and ``{val_split}.jsonl``; ``None`` (default) the
            translation example's shipped subset.
        languages: the JSON fields whose sentences are examples. Default en, de, fr, cs.
        tokenizer: see :func:`load_tokenizer`; ``None`` the shipped tokenizer. The CLI sets it to the model's
            ``pretrained`` checkpoint when one is given.
        max_length: tokens per example at most (longer ones are cut). Default 64.
        batch_size: examples per batch. Default 32.
        val_rows: validation rows used (each gives one example per language); ``None`` all. Default 100.
        num_workers: data loader workers. Default 0.
        train_split: the training file's name. Default ``train``.
        val_split: the validation file's name. Default ``validation``.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        languages: tuple[str, ...] = ("en", "de", "fr", "cs"),
        tokenizer: str | None = None,
        max_length: int = 64,
        batch_size: int = 32,
        val_rows: int | None = 100,
        num_workers: int = 0,
        train_split: str = "train",
        val_split: str = "validation",
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir) if data_dir else TRANSLATION / "data"
        self.languages, self.tokenizer_name, self.max_length = tuple(languages), tokenizer, max_length
        self.batch_size, self.val_rows, self.num_workers = batch_size, val_rows, num_workers
        self.train_split, self.val_split = train_split, val_split
        self.tokenizer = None
        self.train: list[list[int]] = []
        self.val: list[list[int]] = []

    def _examples(self, split: str, rows: int | None) -> list[list[int]]:
        lines = (self.data_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()[:rows]
        sentences = [json.loads(line)[language] for line in lines for language in self.languages]
        tok = self.tokenizer
        encoded = tok(sentences, add_special_tokens=False)["input_ids"]
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        return [(bos + ids + eos)[: self.max_length] for ids in encoded]

    def setup(self, stage: str | None = None) -> None:
        """Load the tokenizer and tokenize both splits (once)."""
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_name)
            self.train = self._examples(self.train_split, None)
            self.val = self._examples(self.val_split, self.val_rows)

    def collate(self, examples: list[list[int]]) -> dict[str, torch.Tensor]:
        """Right-pad ``examples`` to the longest: ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on
        padding), each ``(N, S)`` long."""
        length = max(len(ids) for ids in examples)
        ids = torch.full((len(examples), length), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, example in enumerate(examples):
            ids[row, : len(example)] = torch.tensor(example)
            mask[row, : len(example)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    def train_dataloader(self) -> DataLoader:
        """Shuffled batches of the training sentences."""
        return DataLoader(
            self.train, self.batch_size, shuffle=True, collate_fn=self.collate, num_workers=self.num_workers
        )

    def val_dataloader(self) -> DataLoader:
        """Batches of the validation sentences, in order."""
        return DataLoader(self.val, self.batch_size, collate_fn=self.collate, num_workers=self.num_workers)
