"""Write the small Multi30k subset shipped in ``data/``.

Usage::

    python examples/translation/prepare.py multi30k
    python examples/translation/make_subset.py multi30k

The source directory holds ``train.jsonl`` and ``validation.jsonl`` (one 4-way
aligned sentence per line: ``{"id", "en", "de", "fr", "cs"}``). The first
``--train-rows`` / ``--validation-rows`` rows, in file order, are written
unchanged as JSON Lines with the same columns.
"""

import argparse
from pathlib import Path

from datasets import load_dataset

OUTPUT_DIR = Path(__file__).resolve().parent / "data"
"""Where the subset is written (next to this script)."""


def main() -> None:
    """Parse arguments, then write ``data/train.jsonl`` and ``data/validation.jsonl``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source_dir", type=Path, help="directory holding train.jsonl and validation.jsonl")
    parser.add_argument("--train-rows", type=int, default=3000, help="training rows to keep (default 3000)")
    parser.add_argument("--validation-rows", type=int, default=200, help="validation rows to keep (default 200)")
    args = parser.parse_args()
    rows = {"train": args.train_rows, "validation": args.validation_rows}
    splits = load_dataset("json", data_files={split: str(args.source_dir / f"{split}.jsonl") for split in rows})
    OUTPUT_DIR.mkdir(exist_ok=True)
    for split, count in rows.items():
        subset = splits[split].select(range(count))
        subset.to_json(OUTPUT_DIR / f"{split}.jsonl", lines=True, force_ascii=False)
        print(f"{split}: {len(subset)} rows -> {OUTPUT_DIR / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
