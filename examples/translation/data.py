"""Multi30k (or any aligned multilingual text) as token-bucketed multilingual translation batches.

Data: Multi30k task 1 (Elliott et al. 2016, 2017; Barrault et al. 2018), one
English, German, French and Czech sentence per row. Every row gives one pair
per direction (``en-de``, ``de-en``, ...); the source is prefixed with the
target-language token (``<2de> A man ...``), so one model learns all
directions (GPipe, Huang et al. 2019, section 5). By default the small subset
shipped in ``data/`` is used (see ``data/README.md``), so the example runs
offline from a fresh clone. The full data comes from the Hugging Face Hub
(``--data.dataset_name=bentrevett/multi30k``: English and German) or from a
directory written once by ``prepare.py`` (``--data.data_dir=DIR``: all four
languages).

Batches hold pairs of similar length and at most ``max_tokens`` padded tokens
per side, and are padded to their own longest sequence, so batch shapes change
from step to step.
"""

from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from example_data import check_directory, check_hub, load_hub, missing_files
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from translation.conventions import Convention
from translation.vocabulary import language_token, load_tokenizer

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"
"""The shipped subset: ``train.jsonl`` (3,000 rows) and ``validation.jsonl`` (200 rows)."""

DIRECTIONS = ("en-de", "de-en", "en-fr", "fr-en", "en-cs", "cs-en")
"""The six directions of the multilingual model, ``source-target``."""

HUB_DATASET = "bentrevett/multi30k"
"""Multi30k's English-German pairs on the Hugging Face Hub: splits ``train``, ``validation`` and ``test``
(``test_2016_flickr``), columns ``en`` and ``de``."""

SPLIT_ALIASES = {"test_2016_flickr": "test", "test": "test_2016_flickr"}
"""Another name to try for a split that is missing: the release's test split is ``test_2016_flickr`` in a
``prepare.py`` directory and ``test`` in :data:`HUB_DATASET`."""

PREPARE = "python examples/translation/prepare.py DIR"
"""The command that writes a data directory (see ``prepare.py``)."""

ADVICE = (
    f"Write the files once, on a machine with network, with\n    {PREPARE}\n"
    "(the full Multi30k, all four languages, from its release on GitHub) and pass --data.data_dir=DIR; or load the "
    f"English-German pairs from the Hugging Face Hub with --data.dataset_name={HUB_DATASET} (needs network, or a "
    "copy in the Hugging Face cache with HF_HUB_OFFLINE=1). Without either option the example trains on the small "
    "subset shipped in examples/translation/data."
)
"""What to do when the data cannot be read (the end of :class:`~example_data.DataUnavailableError`'s message)."""


def available_directions(rows: datasets.Dataset) -> list[str]:
    """The directions of :data:`DIRECTIONS` whose two languages are both columns of ``rows``."""
    return [d for d in DIRECTIONS if all(language in rows.column_names for language in d.split("-"))]


@dataclass
class Pair:
    """One tokenized sentence pair.

    Attributes:
        source: source ids, ``</s>`` last, after what the model's convention puts first (the example's target-language
            token; see :class:`~translation.conventions.Convention`).
        target: target ids, without begin or end token (NLLB's and mBART-50's after the target's language code).
        direction: ``"en-de"`` style.
        reference: the raw target sentence (for BLEU).
    """

    source: list[int]
    target: list[int]
    direction: str
    reference: str


def make_pairs(
    rows: datasets.Dataset, directions: list[str], convention: Convention, max_length: int | None = None
) -> list[Pair]:
    """Tokenize every row of ``rows`` once per direction, with the model's language convention.

    Args:
        rows: a split with one text column per language.
        directions: ``"src-tgt"`` names; a direction listed twice yields its pairs twice (oversampling).
        convention: the model's :class:`~translation.conventions.Convention` (its tokenizer, and what it reads
            before and after each sentence: the example's ``<2de>`` token first, T5's task prefix, NLLB's codes).
        max_length: drop pairs whose source (with what the convention adds) or target (with ``</s>``) is longer,
            in tokens; ``None`` keeps all.

    Raises:
        ValueError: for a direction whose languages are not in ``vocabulary.LANGUAGES``, or that the convention's
            tokenizer cannot express (:meth:`~translation.conventions.Convention.check`).
    """
    tokenizer = convention.tokenizer
    languages = sorted({language for direction in directions for language in _split_direction(direction)})
    convention.check(directions)
    texts = {language: list(rows[language]) for language in languages}
    ids = {language: tokenizer(texts[language], add_special_tokens=False)["input_ids"] for language in languages}
    pairs = []
    for direction in directions:
        source, target = _split_direction(direction)
        (head, tail), start = convention.source_ends(source, target), convention.target_start(target)
        for src, tgt, reference in zip(ids[source], ids[target], texts[target], strict=True):
            src, tgt = [*head, *src, *tail], [*start, *tgt]
            if max_length is None or (len(src) <= max_length and len(tgt) + 1 <= max_length):
                pairs.append(Pair(src, tgt, direction, reference))
    return pairs


def _split_direction(direction: str) -> tuple[str, str]:
    """``"en-de"`` -> ``("en", "de")``, checking both languages."""
    source, _, target = direction.partition("-")
    for language in (source, target):
        language_token(language)  # raises ValueError for an unknown language
    return source, target


def bucket(pairs: list[Pair], max_tokens: int, seed: int) -> list[list[Pair]]:
    """Group pairs of similar length into batches of at most ``max_tokens`` padded tokens per side.

    Pairs are sorted by (source length, target length), ties broken in a random
    order drawn from ``seed`` (the same on every stage process), then cut
    greedily: a batch of N pairs padded to lengths (S, T) keeps N * max(S, T) <= max_tokens.

    Args:
        pairs: the pairs to group.
        max_tokens: padded tokens per side of a batch (a single longer pair gets a batch of its own).
        seed: seed of the tie-breaking order.
    """
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    order.sort(key=lambda i: (len(pairs[i].source), len(pairs[i].target)))
    batches, current, longest = [], [], 0
    for i in order:
        length = max(len(pairs[i].source), len(pairs[i].target) + 1)
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(pairs[i])
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def collate(pairs: list[Pair], bos_id: int, eos_id: int, pad_id: int) -> dict:
    """Pad a batch to its longest sequences.

    Returns:
        ``{"src": (N, S) long, "tgt_in": (N, T) long, "tgt_out": (N, T) long, "directions": [str] * N,
        "references": [str] * N}``: ``tgt_in`` is ``<s>`` (``bos_id``) + target (the example's decoder input; a
        Hugging Face model shifts ``tgt_out`` right itself), ``tgt_out`` is target + ``</s>`` (what the decoder must
        predict); padding is ``pad_id``.
    """
    src = _pad([pair.source for pair in pairs], pad_id)
    tgt_in = _pad([[bos_id, *pair.target] for pair in pairs], pad_id)
    tgt_out = _pad([[*pair.target, eos_id] for pair in pairs], pad_id)
    return {
        "src": src,
        "tgt_in": tgt_in,
        "tgt_out": tgt_out,
        "directions": [pair.direction for pair in pairs],
        "references": [pair.reference for pair in pairs],
    }


def _pad(sequences: list[list[int]], pad_id: int) -> Tensor:
    """``(N, longest)`` long tensor of the sequences, right-padded with ``pad_id``."""
    out = torch.full((len(sequences), max(map(len, sequences))), pad_id, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        out[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
    return out


class BatchDataset(Dataset):
    """Map-style dataset whose items are whole, collated batches (see :func:`collate`).

    Args:
        batches: pairs grouped by :func:`bucket`.
        tokenizer: gives the begin (the padding id for a tokenizer without one, T5's), end and padding ids.
    """

    def __init__(self, batches: list[list[Pair]], tokenizer) -> None:
        self.batches = batches
        bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
        self.ids = (pad if bos is None else bos, tokenizer.eos_token_id, pad)

    def __len__(self) -> int:
        """Number of batches."""
        return len(self.batches)

    def __getitem__(self, index: int) -> dict:
        """The padded batch ``index``."""
        return collate(self.batches[index], *self.ids)


class TranslationDataModule(LightningDataModule):
    """Multilingual translation batches from Multi30k-style aligned text (see :func:`collate`).

    The order of training batches is shuffled each epoch by a ``DistributedSampler``
    over one replica seeded with ``seed``: it is the same on every stage of the
    pipeline and on a single device (Lightning keeps a ``DistributedSampler`` as it
    is), so pipelined and single-device runs see the same batches.

    Args:
        data_dir: directory holding ``<train_split>.jsonl`` and ``<val_split>.jsonl`` (columns ``en``, ``de``,
            ``fr``, ``cs``), e.g. the full Multi30k written by ``prepare.py``. When given, it is read instead of
            ``dataset_name``.
        dataset_name: a Hugging Face Hub dataset with such columns (some of them), loaded with
            ``datasets.load_dataset(dataset_name)`` (needs network access, or a copy in the Hugging Face cache),
            e.g. :data:`HUB_DATASET`. Default (neither): the subset shipped next to this file. A split missing
            under its name is looked up under its :data:`SPLIT_ALIASES` name.
        tokenizer_file: the shared vocabulary (``tokenizer.json``), or a Hugging Face model's directory holding its
            tokenizer (``AutoTokenizer.from_pretrained``). Default: the shipped one.
        model_type: the Hugging Face model type whose language convention the sources and targets follow (T5's task
            prefix, NLLB's and mBART-50's language codes; see :mod:`translation.conventions`). Default (``None``):
            the example's own model, the target-language token before the source. ``train.py`` sets it from
            ``--model``.
        train_directions: directions to train on; a direction listed twice is seen twice per epoch.
            Default (``None``): those of :data:`DIRECTIONS` whose languages the data holds (all six in the
            shipped subset and a ``prepare.py`` directory; en-de and de-en in :data:`HUB_DATASET`).
        val_directions: directions to validate on. Default (``None``): the same rule.
        max_tokens: padded tokens per side of a training batch. Default 4096.
        val_max_tokens: the same for validation and predict batches. Default 4096.
        val_rows: validate on the first ``val_rows`` rows of the validation split only; ``None``: all.
            Default 50 (times the directions: 300 pairs, each decoded for BLEU).
        max_length: drop training pairs longer than this, in tokens. Default 128.
        predict_sentences: sentences to translate with ``predict``, 32 per batch. Default: none.
        predict_file: a UTF-8 text file of sentences to translate with ``predict``, one per line (after
            ``predict_sentences``, if both are given). Default: none.
        predict_target: language to translate them into. Default ``"de"``.
        predict_source: their language (what a Hugging Face model's convention names). Default ``"en"``.
        seed: seed of the bucketing and of the batch order. Default 0.
        num_workers: DataLoader worker processes. Default 0.
        train_split: name of the training split. Default ``"train"``.
        val_split: name of the validation split. Default ``"validation"``.

    Raises:
        example_data.DataUnavailableError: from :meth:`check_data`, :meth:`prepare_data` and :meth:`setup`, when
            ``data_dir`` lacks the files or the Hub dataset cannot be reached; the message names the flag and
            the ``prepare.py`` command.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        dataset_name: str | None = None,
        tokenizer_file: str | None = None,
        model_type: str | None = None,
        train_directions: list[str] | None = None,
        val_directions: list[str] | None = None,
        max_tokens: int = 4096,
        val_max_tokens: int = 4096,
        val_rows: int | None = 50,
        max_length: int = 128,
        predict_sentences: list[str] | None = None,
        predict_file: str | None = None,
        predict_target: str = "de",
        predict_source: str = "en",
        seed: int = 0,
        num_workers: int = 0,
        train_split: str = "train",
        val_split: str = "validation",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tokenizer = load_tokenizer(tokenizer_file)
        self.convention = Convention(self.tokenizer, model_type)
        self.train_set: BatchDataset | None = None
        self.val_set: BatchDataset | None = None

    def check_data(self, stage: str | None = None) -> None:
        """Fail fast, with :data:`ADVICE`, when the data ``stage`` needs cannot be read: a ``data_dir`` without
        the files, or a Hub dataset out of reach (one short request; see :func:`example_data.check_hub`). Nothing
        to check for ``predict``, which reads its own sentences. The examples' CLI calls it before the Trainer
        starts the stage processes."""
        hp = self.hparams
        if stage == "predict":
            return
        if hp.data_dir is not None:
            for split in self._splits():
                check_directory(hp.data_dir, [self._file_of(Path(hp.data_dir), split).name], ADVICE)
        elif hp.dataset_name is not None:
            check_hub(hp.dataset_name, ADVICE)

    def prepare_data(self) -> None:
        """Download (hub) or convert (JSON Lines) the dataset once, into the ``datasets`` cache."""
        self.check_data()
        self._load()

    def setup(self, stage: str) -> None:
        """Tokenize and bucket the splits that ``stage`` needs."""
        hp = self.hparams
        if stage in ("fit", "validate"):
            splits = self._load()
            if stage == "fit":
                train = self._split(splits, hp.train_split)
                directions = hp.train_directions or available_directions(train)
                pairs = make_pairs(train, directions, self.convention, hp.max_length)
                self.train_set = BatchDataset(bucket(pairs, hp.max_tokens, hp.seed), self.tokenizer)
            rows = self._split(splits, hp.val_split)
            if hp.val_rows is not None:
                rows = rows.select(range(min(hp.val_rows, len(rows))))
            pairs = make_pairs(rows, hp.val_directions or available_directions(rows), self.convention)
            self.val_set = BatchDataset(bucket(pairs, hp.val_max_tokens, hp.seed), self.tokenizer)

    def train_dataloader(self) -> DataLoader:
        """Training batches in a seeded order, reshuffled each epoch."""
        sampler = DistributedSampler(self.train_set, num_replicas=1, rank=0, shuffle=True, seed=self.hparams.seed)
        return DataLoader(self.train_set, batch_size=None, sampler=sampler, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Validation batches, shortest first."""
        return DataLoader(self.val_set, batch_size=None, num_workers=self.hparams.num_workers)

    def predict_dataloader(self) -> DataLoader:
        """``predict_sentences`` and the lines of ``predict_file`` in their order, as batches ``{"src": (N, S)
        long, "directions": [str] * N}`` to translate from ``predict_source`` into ``predict_target``."""
        hp = self.hparams
        sentences = list(hp.predict_sentences or [])
        if hp.predict_file is not None:
            sentences += Path(hp.predict_file).read_text(encoding="utf-8").splitlines()
        direction = f"{hp.predict_source}-{hp.predict_target}"
        _split_direction(direction)
        self.convention.check([direction])
        head, tail = self.convention.source_ends(hp.predict_source, hp.predict_target)
        ids = self.tokenizer(sentences, add_special_tokens=False)["input_ids"]
        sources = [[*head, *sentence, *tail] for sentence in ids]
        batches = [sources[i : i + 32] for i in range(0, len(sources), 32)]
        pad = self.tokenizer.pad_token_id
        return DataLoader(
            [{"src": _pad(batch, pad), "directions": [direction] * len(batch)} for batch in batches], batch_size=None
        )

    def _splits(self) -> list[str]:
        """The names of the training and the validation split (once if they are the same)."""
        return list(dict.fromkeys((self.hparams.train_split, self.hparams.val_split)))

    @staticmethod
    def _file_of(directory: Path, split: str) -> Path:
        """``directory/<split>.jsonl``, or the file of the split's :data:`SPLIT_ALIASES` name when only that
        exists."""
        alias = SPLIT_ALIASES.get(split)
        if missing_files(directory, [f"{split}.jsonl"]) and alias and not missing_files(directory, [f"{alias}.jsonl"]):
            return directory / f"{alias}.jsonl"
        return directory / f"{split}.jsonl"

    @staticmethod
    def _split(splits: datasets.DatasetDict, name: str) -> datasets.Dataset:
        """Split ``name`` of ``splits``, else the one of its :data:`SPLIT_ALIASES` name."""
        if name not in splits and SPLIT_ALIASES.get(name) in splits:
            return splits[SPLIT_ALIASES[name]]
        return splits[name]

    def _load(self) -> datasets.DatasetDict:
        """Load the two JSON Lines splits of ``data_dir`` (or of the shipped subset), or the hub dataset."""
        hp = self.hparams
        if hp.data_dir is None and hp.dataset_name is not None:
            return load_hub(hp.dataset_name, ADVICE)
        directory = Path(hp.data_dir) if hp.data_dir is not None else DEFAULT_DATA_DIR
        files = {split: self._file_of(directory, split) for split in self._splits()}
        check_directory(directory, [path.name for path in files.values()], ADVICE)
        return datasets.load_dataset("json", data_files={split: str(path) for split, path in files.items()})
