"""Write the CIFAR-10 files the AmoebaNet-D recipes read, so that training needs no network afterwards.

Usage (from the repository root)::

    python examples/amoebanet/prepare.py DIR                       # the 30,000-image subset of cifar10_20min.yaml
    python examples/amoebanet/prepare.py DIR --train-per-class=0   # all 50,000 training images
    python examples/amoebanet/train.py fit --config examples/amoebanet/configs/cifar10_20min.yaml --data.data_dir=DIR

Reads CIFAR-10 from the Hugging Face Hub (``uoft-cs/cifar10``: 50,000 training and 10,000 test images) or from
``--source=SRC``, a directory holding ``train.parquet`` and ``test.parquet``, and writes ``DIR/train.parquet``
(the first ``--train-per-class`` images of each class, shuffled with ``--seed``: see ``data.class_subset``) and
``DIR/test.parquet`` (the whole test split), Hugging Face ``datasets`` parquet with an Image and a ClassLabel
column.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import datasets
from example_data import DataUnavailableError, check_directory, check_hub, load_hub

from amoebanet.data import HUB_DATASET, SUBSET_SEED, class_subset

ADVICE = (
    f"prepare.py downloads {HUB_DATASET} from the Hugging Face Hub once, so it needs network (or a copy in the "
    "Hugging Face cache with HF_HUB_OFFLINE=1); run it where there is network and copy DIR over, or give "
    "--source=SRC, a directory holding train.parquet and test.parquet."
)
"""What to do when the source cannot be read."""

SPLITS = ("train", "test")
"""The splits written, under their own names (``--data.train_split`` and ``--data.val_split`` defaults)."""


def prepare(out_dir: Path, source: str = HUB_DATASET, train_per_class: int = 3000, seed: int = SUBSET_SEED) -> dict:
    """Write ``out_dir/train.parquet`` and ``out_dir/test.parquet``.

    Args:
        out_dir: where the files go (created if missing).
        source: a Hugging Face Hub dataset name, or a directory holding ``train.parquet`` and ``test.parquet``.
        train_per_class: training images kept per class (:func:`~amoebanet.data.class_subset`); 0: all.
        seed: seed of the training subset's order.

    Returns:
        The number of rows written per split.

    Raises:
        example_data.DataUnavailableError: when ``source`` cannot be read (a missing directory, the Hub out of reach).
    """
    if Path(source).is_dir() or source.startswith((".", "/")):
        check_directory(source, [f"{split}.parquet" for split in SPLITS], ADVICE, flag="--source")
        files = {split: str(Path(source) / f"{split}.parquet") for split in SPLITS}
        splits = datasets.load_dataset("parquet", data_files=files)
    else:
        check_hub(source, ADVICE, flag="--source")
        splits = load_hub(source, ADVICE, flag="--source")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for split in SPLITS:
        rows = splits[split]
        if split == "train" and train_per_class > 0:
            rows = class_subset(rows, train_per_class, seed)
        rows.to_parquet(out_dir / f"{split}.parquet")
        written[split] = len(rows)
    return written


def main(args: list[str] | None = None) -> None:
    """Parse the command line and write the files."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="directory to write train.parquet and test.parquet into")
    parser.add_argument("--source", default=HUB_DATASET, help=f"Hub dataset or parquet directory ({HUB_DATASET})")
    parser.add_argument("--train-per-class", type=int, default=3000, help="training images per class; 0: all")
    parser.add_argument("--seed", type=int, default=SUBSET_SEED, help=f"order of the subset (default {SUBSET_SEED})")
    options = parser.parse_args(args)
    try:
        written = prepare(options.out_dir, options.source, options.train_per_class, options.seed)
    except DataUnavailableError as error:
        sys.exit(f"error: {error}")
    for split, rows in written.items():
        print(f"{split}: {rows} rows -> {options.out_dir / f'{split}.parquet'}")


if __name__ == "__main__":
    main()
