"""CIFAR-10 (or any Hugging Face image-classification dataset) as a LightningDataModule.

Data: "Learning Multiple Layers of Features from Tiny Images", A. Krizhevsky,
2009. By default the small class-balanced subset shipped in ``data/`` is used
(see ``data/README.md``), so the example runs offline from a fresh clone. The
full data comes from the Hugging Face Hub (``--data.dataset_name=uoft-cs/cifar10``)
or from a directory written once by ``prepare.py`` (``--data.data_dir=DIR``).
"""

from pathlib import Path

import datasets
import numpy as np
import torch
from example_data import check_directory, check_hub, load_hub
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from amoebanet.transforms import CIFAR10_MEAN, CIFAR10_STD, ImageTransform, decode

DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"
"""The shipped subset: ``train.parquet`` (2,000 images) and ``test.parquet`` (500)."""

HUB_DATASET = "uoft-cs/cifar10"
"""CIFAR-10 on the Hugging Face Hub: 50,000 training and 10,000 test images (PNG), columns ``img`` and ``label``."""

SUBSET_SEED = 20240611
"""Seed of the order of the 30,000-image training subset (:func:`class_subset`)."""

PREPARE = "python examples/amoebanet/prepare.py DIR"
"""The command that writes a data directory (see ``prepare.py``)."""

ADVICE = (
    f"Write the files once, on a machine with network, with\n    {PREPARE}\n"
    "(CIFAR-10 from the Hugging Face Hub; the 30,000-image training subset of configs/cifar10_20min.yaml by default)"
    " and pass --data.data_dir=DIR; or load the Hub dataset with --data.dataset_name=uoft-cs/cifar10 (needs "
    "network, or a copy in the Hugging Face cache with HF_HUB_OFFLINE=1). Without either option the example trains "
    "on the small subset shipped in examples/amoebanet/data."
)
"""What to do when the data cannot be read (the end of :class:`~example_data.DataUnavailableError`'s message)."""


class ImageClassificationDataset(Dataset):
    """Map-style dataset of ``(image (3, S, S) float, label int)`` over a Hugging Face split.

    The image column is the split's first ``datasets.Image`` feature (``image``
    in the shipped parquet files, ``img`` in ``uoft-cs/cifar10``); the label
    column is its first ``datasets.ClassLabel`` feature, else ``label``.

    Args:
        split: a Hugging Face ``datasets.Dataset``.
        transform: turns a PIL image (or a decoded uint8 one) into a tensor.
        decode_once: decode every image once, here, and keep them as uint8 tensors (3 x S x S bytes each:
            92 MB for 30,000 CIFAR images), instead of decoding each JPEG or PNG again every epoch. Default False.
    """

    def __init__(self, split: datasets.Dataset, transform: ImageTransform, decode_once: bool = False) -> None:
        self.split = split
        self.transform = transform
        self.image_column = _column_of_type(split.features, datasets.Image, None)
        self.label_column = _column_of_type(split.features, datasets.ClassLabel, "label")
        self.decoded: list[tuple[Tensor, int]] | None = None
        if decode_once:
            images, labels = split[self.image_column], split[self.label_column]
            self.decoded = [(decode(image, transform.image_size), int(label)) for image, label in zip(images, labels)]

    def __len__(self) -> int:
        """Number of images."""
        return len(self.split)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        """Return the transformed image and the label of row ``index``."""
        if self.decoded is not None:
            image, label = self.decoded[index]
            return self.transform(image), label
        row = self.split[index]
        return self.transform(row[self.image_column]), int(row[self.label_column])


def _column_of_type(features: datasets.Features, feature_type: type, default: str | None) -> str:
    """Name of the first column whose feature is a ``feature_type``, else ``default``."""
    for name, feature in features.items():
        if isinstance(feature, feature_type):
            return name
    if default is None:
        raise ValueError(f"no {feature_type.__name__} column in {list(features)}")
    return default


def class_subset(split: datasets.Dataset, per_class: int, seed: int = SUBSET_SEED) -> datasets.Dataset:
    """The first ``per_class`` rows of every class of ``split``, in a seeded random order.

    The rows are chosen in the split's own order (for ``uoft-cs/cifar10``: CIFAR-10's order), then shuffled with
    ``numpy.random.default_rng(seed).permutation``. A split with no class above ``per_class`` rows is returned
    unchanged, so choosing again from a subset written by ``prepare.py`` keeps it as it is.

    Args:
        split: a split with a ``datasets.ClassLabel`` column (else ``label``).
        per_class: rows to keep of each class.
        seed: seed of the order. Default :data:`SUBSET_SEED`.
    """
    labels = split[_column_of_type(split.features, datasets.ClassLabel, "label")]
    seen: dict[int, int] = {}
    keep = []
    for row, label in enumerate(labels):
        seen[label] = seen.get(label, 0) + 1
        if seen[label] <= per_class:
            keep.append(row)
    if len(keep) == len(labels):
        return split
    order = np.random.default_rng(seed).permutation(len(keep))
    return split.select([keep[i] for i in order])


def collate(samples: list[tuple[Tensor, int]]) -> tuple[Tensor, Tensor]:
    """Stack samples into ``(images (N, 3, S, S) float, labels (N,) long)``."""
    images, labels = zip(*samples, strict=True)
    return torch.stack(images), torch.tensor(labels, dtype=torch.long)


class CIFAR10DataModule(LightningDataModule):
    """CIFAR-10 batches ``(images (N, 3, S, S) float, labels (N,) long)``, normalised.

    Training images are augmented (random crop with padding, horizontal flip)
    and the last incomplete training batch is dropped. No sampler is set:
    Lightning's strategy adds a distributed one when it needs it.

    Args:
        data_dir: directory holding ``<train_split>.parquet`` and
            ``<val_split>.parquet`` (Hugging Face ``datasets`` parquet with an
            Image and a ClassLabel column), e.g. written by ``prepare.py``. When
            given, it is read instead of ``dataset_name``.
        dataset_name: a Hugging Face Hub dataset, e.g. ``"uoft-cs/cifar10"``,
            loaded with ``datasets.load_dataset(dataset_name)`` (needs network
            access, or a copy in the Hugging Face cache). Default (neither): the
            subset shipped next to this file.
        batch_size: images per batch (per pipeline, all micro-batches). Default 32.
        num_workers: DataLoader worker processes. Default 0.
        image_size: side S that images are resized to. Default 32.
        mean: per-channel normalisation mean. Default: CIFAR-10's.
        std: per-channel normalisation standard deviation. Default: CIFAR-10's.
        train_split: name of the training split. Default ``"train"``.
        val_split: name of the validation split. Default ``"test"``.
        decode_once: decode the images once at setup and keep them in memory as uint8 (see
            :class:`ImageClassificationDataset`); for CIFAR-sized data, not ImageNet. Default False.
        train_per_class: train on the first ``train_per_class`` images of each class only, in the order
            :func:`class_subset` draws from ``subset_seed``; ``None`` (default): every training image.
        subset_seed: seed of that order. Default :data:`SUBSET_SEED`.

    Raises:
        example_data.DataUnavailableError: from :meth:`check_data`, :meth:`prepare_data` and :meth:`setup`, when
            ``data_dir`` lacks the files or the Hub dataset cannot be reached; the message names the flag and
            the ``prepare.py`` command.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        dataset_name: str | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        image_size: int = 32,
        mean: tuple[float, float, float] = CIFAR10_MEAN,
        std: tuple[float, float, float] = CIFAR10_STD,
        train_split: str = "train",
        val_split: str = "test",
        decode_once: bool = False,
        train_per_class: int | None = None,
        subset_seed: int = SUBSET_SEED,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: ImageClassificationDataset | None = None
        self.val_set: ImageClassificationDataset | None = None

    def check_data(self, stage: str | None = None) -> None:
        """Fail fast, with :data:`ADVICE`, when the data cannot be read: a ``data_dir`` without the two files, or
        a Hub dataset out of reach (one short request; see :func:`example_data.check_hub`). The examples' CLI
        calls it before the Trainer starts the stage processes."""
        hp = self.hparams
        if hp.data_dir is not None:
            check_directory(hp.data_dir, [f"{split}.parquet" for split in (hp.train_split, hp.val_split)], ADVICE)
        elif hp.dataset_name is not None:
            check_hub(hp.dataset_name, ADVICE)

    def prepare_data(self) -> None:
        """Download (hub) or convert (parquet) the dataset once, into the ``datasets`` cache."""
        self.check_data()
        self._load()

    def setup(self, stage: str) -> None:
        """Build the training and validation datasets from the cached splits."""
        splits = self._load()
        hp = self.hparams
        train = splits[hp.train_split]
        if hp.train_per_class is not None:
            train = class_subset(train, hp.train_per_class, hp.subset_seed)
        self.train_set = ImageClassificationDataset(
            train, ImageTransform(hp.image_size, hp.mean, hp.std, augment=True), hp.decode_once
        )
        self.val_set = ImageClassificationDataset(
            splits[hp.val_split], ImageTransform(hp.image_size, hp.mean, hp.std, augment=False), hp.decode_once
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; the last incomplete batch is dropped."""
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        """Validation batches in order, the last one possibly smaller."""
        return self._loader(self.val_set, train=False)

    def _loader(self, dataset: ImageClassificationDataset | None, train: bool) -> DataLoader:
        """A DataLoader over ``dataset`` with this module's batch size and workers."""
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=train,
            drop_last=train,
            num_workers=self.hparams.num_workers,
            collate_fn=collate,
        )

    def _load(self) -> datasets.DatasetDict:
        """Load the two parquet splits of ``data_dir`` (or of the shipped subset), or the hub dataset."""
        hp = self.hparams
        if hp.data_dir is None and hp.dataset_name is not None:
            return load_hub(hp.dataset_name, ADVICE)
        directory = Path(hp.data_dir) if hp.data_dir is not None else DEFAULT_DATA_DIR
        check_directory(directory, [f"{split}.parquet" for split in (hp.train_split, hp.val_split)], ADVICE)
        files = {split: str(directory / f"{split}.parquet") for split in (hp.train_split, hp.val_split)}
        return datasets.load_dataset("parquet", data_files=files)
