"""Real text for causal-LM fine-tuning, shipped in the repository: the translation example's Multi30k sentences.

The default reads ``examples/translation/data/{train,validation}.jsonl`` in place (3,000 and 200 rows, each a
sentence in English, German, French and Czech; see that directory's README for the source and licence) and
tokenizes with ``examples/translation/tokenizer.json`` (BPE, 8,000 tokens, ``<pad>`` 0, ``<s>`` 2, ``</s>`` 3). Every
sentence of every chosen language is one document, ``<s> sentence </s>``.

Batches come three ways. By default ``batch_size`` documents, padded on the right to the longest (label ``-100`` on
padding). With ``max_tokens``, as many documents (in a seeded random order) as keep ``rows * longest <= max_tokens``:
a token budget, so that batches, and the micro-batches the pipeline cuts them into, carry similar work. With
``packing``, documents packed into rows of ``max_length`` tokens with no padding between them (positions restarting
per document, attention kept inside each: :func:`lightning_gpipe.hf.packed_batch`), ``max_tokens // max_length`` rows
a batch (``batch_size`` rows without ``max_tokens``). Every batch carries ``num_targets`` and ``num_rows``, which make
``CausalLM``'s loss the mean over the batch's predicted tokens under every schedule.
"""

import json
import random
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_gpipe.hf import pack_documents, packed_batch

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


def budget_batches(documents: list[list[int]], max_tokens: int, seed: int) -> list[list[list[int]]]:
    """``documents`` in a seeded random order, grouped into batches of at most ``max_tokens`` padded tokens: a batch
    takes the next document while ``rows * longest <= max_tokens`` (a longer document gets a batch of its own)."""
    order = list(documents)
    random.Random(seed).shuffle(order)
    batches: list[list[list[int]]] = []
    longest = 0
    for document in order:
        longest = max(longest, len(document))
        if not batches or (len(batches[-1]) + 1) * longest > max_tokens:
            batches.append([])
            longest = len(document)
        batches[-1].append(document)
    return batches


def packed_batches(documents: list[list[int]], row_length: int, rows: int, seed: int) -> list[list[list[list[int]]]]:
    """``documents`` in a seeded random order, packed into rows of ``row_length`` tokens
    (:func:`lightning_gpipe.hf.pack_documents`), ``rows`` rows a batch."""
    order = list(documents)
    random.Random(seed).shuffle(order)
    packed = pack_documents(order, row_length)
    return [[list(row) for row in packed[i : i + rows]] for i in range(0, len(packed), rows)]


class TextDataModule(L.LightningDataModule):
    """Sentences of JSON Lines files as causal-LM batches (``input_ids``, ``attention_mask``, ``labels``; packed:
    ``position_ids`` too), padded, under a token budget, or packed (see the module docstring).

    Args:
        data_dir: a directory with ``{train_split}.jsonl`` and ``{val_split}.jsonl``; ``None`` (default) the
            translation example's shipped subset.
        languages: the JSON fields whose sentences are documents. Default en, de, fr, cs.
        tokenizer: see :func:`load_tokenizer`; ``None`` the shipped tokenizer. The CLI sets it to the model's
            ``pretrained`` checkpoint when one is given.
        max_length: tokens per document at most (longer ones are cut); with ``packing`` also the row length.
            Default 64.
        batch_size: documents per batch (rows with ``packing``), when ``max_tokens`` is not given. Default 32.
        val_rows: validation rows used (each gives one document per language); ``None`` all. Default 100.
        num_workers: data loader workers. Default 0.
        train_split: the training file's name. Default ``train``.
        val_split: the validation file's name. Default ``validation``.
        max_tokens: a token budget per batch (padded tokens, or ``max_tokens // max_length`` packed rows) instead of
            ``batch_size``; ``None`` (default) for ``batch_size``.
        packing: pack documents into rows of ``max_length`` tokens. Default ``False``.
        seed: the order documents are batched or packed in. Default 0.
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
        max_tokens: int | None = None,
        packing: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir) if data_dir else TRANSLATION / "data"
        self.languages, self.tokenizer_name, self.max_length = tuple(languages), tokenizer, max_length
        self.batch_size, self.val_rows, self.num_workers = batch_size, val_rows, num_workers
        self.train_split, self.val_split = train_split, val_split
        self.max_tokens, self.packing, self.seed = max_tokens, packing, seed
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

    def collate(self, examples: list[list[int]]) -> dict:
        """Right-pad ``examples`` to the longest: ``input_ids``, ``attention_mask`` and ``labels`` (``-100`` on
        padding), each ``(N, S)`` long, and the ints ``num_targets`` (the tokens predicted) and ``num_rows``."""
        length = max(len(ids) for ids in examples)
        ids = torch.full((len(examples), length), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, example in enumerate(examples):
            ids[row, : len(example)] = torch.tensor(example)
            mask[row, : len(example)] = 1
        targets = sum(max(len(example) - 1, 0) for example in examples)
        labels = ids.masked_fill(mask == 0, -100)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "num_targets": targets,
            "num_rows": len(examples),
        }

    def collate_rows(self, rows: list[list[list[int]]]) -> dict:
        """A batch of packed rows (:func:`lightning_gpipe.hf.packed_batch`)."""
        return packed_batch(rows, self.tokenizer.pad_token_id)

    def _loader(self, documents: list[list[int]], shuffle: bool) -> DataLoader:
        workers = self.num_workers
        if self.packing:
            rows = self.max_tokens // self.max_length if self.max_tokens else self.batch_size
            batches = packed_batches(documents, self.max_length, max(rows, 1), self.seed)
            return DataLoader(batches, None, shuffle=shuffle, collate_fn=self.collate_rows, num_workers=workers)
        if self.max_tokens:
            batches = budget_batches(documents, self.max_tokens, self.seed)
            return DataLoader(batches, None, shuffle=shuffle, collate_fn=self.collate, num_workers=workers)
        return DataLoader(documents, self.batch_size, shuffle=shuffle, collate_fn=self.collate, num_workers=workers)

    def train_dataloader(self) -> DataLoader:
        """Batches of the training sentences, in a shuffled order (padded, under a token budget, or packed)."""
        return self._loader(self.train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Batches of the validation sentences, in order (made as the training batches are)."""
        return self._loader(self.val, shuffle=False)
