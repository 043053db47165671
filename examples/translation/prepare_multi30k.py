"""Turn Multi30k's own release (task 1, raw text) into the JSON Lines files ``--data.data_dir`` reads.

Multi30k (Elliott et al. 2016, 2017; Barrault et al. 2018) is released in the GitHub repository
``multi30k/dataset`` as one gzipped text file per split and language, aligned line by line:
``data/task1/raw/{train,val,test_2016_flickr}.{en,de,fr,cs}.gz``. Download them, e.g. at the commit
the shipped subset was made from::

    base=https://raw.githubusercontent.com/multi30k/dataset/a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw
    mkdir -p multi30k_raw && for split in train val test_2016_flickr; do for lang in en de fr cs; do
        curl -fsSL -o multi30k_raw/$split.$lang.gz $base/$split.$lang.gz; done; done

then write ``train.jsonl`` (29,000 rows), ``validation.jsonl`` (1,014) and ``test_2016_flickr.jsonl``
(1,000), one 4-way aligned sentence per line, ``{"id", "en", "de", "fr", "cs"}``, with leading and
trailing whitespace stripped::

    python examples/translation/prepare_multi30k.py multi30k_raw multi30k
    python examples/translation/train.py fit --config examples/translation/configs/multi30k_30min.yaml \\
        --data.data_dir=multi30k

Uncompressed files (``train.en`` ...) are read as well.
"""

import argparse
import gzip
import json
from pathlib import Path

SPLITS = {"train": "train", "val": "validation", "test_2016_flickr": "test_2016_flickr"}
"""File name of each split in the release -> name of the JSON Lines file (the data module's split name)."""

LANGUAGES = ("en", "de", "fr", "cs")
"""The four languages of Multi30k task 1."""


def read_lines(path: Path) -> list[str]:
    """The lines of ``path`` (or of ``path`` + ``.gz`` when only that exists) as UTF-8 text, each stripped.

    Lines end at ``\\n`` only, so that no other line-break character inside a sentence breaks the alignment.

    Raises:
        FileNotFoundError: when neither file exists.
    """
    if path.exists():
        text = path.read_bytes().decode("utf-8")
    else:
        with gzip.open(path.with_name(path.name + ".gz"), "rt", encoding="utf-8", newline="") as f:
            text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


def convert(raw_dir: Path, out_dir: Path) -> dict[str, int]:
    """Write one JSON Lines file per split of ``raw_dir`` into ``out_dir``.

    Args:
        raw_dir: directory holding ``{train,val,test_2016_flickr}.{en,de,fr,cs}[.gz]``.
        out_dir: where ``train.jsonl``, ``validation.jsonl`` and ``test_2016_flickr.jsonl`` go (created if
            missing).

    Returns:
        The number of rows written per output split.

    Raises:
        FileNotFoundError: when a split's file is missing for one of the languages.
        ValueError: when the four languages of a split have different numbers of lines.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, split in SPLITS.items():
        columns = {language: read_lines(raw_dir / f"{name}.{language}") for language in LANGUAGES}
        lengths = {language: len(lines) for language, lines in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"{name}: the languages have different numbers of lines, {lengths}")
        with open(out_dir / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for index, sentences in enumerate(zip(*columns.values())):
                row = {"id": index, **dict(zip(LANGUAGES, sentences))}
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        written[split] = lengths["en"]
    return written


def main() -> None:
    """Parse the two directories and convert."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("raw_dir", type=Path, help="directory with the release's {split}.{language}.gz files")
    parser.add_argument("out_dir", type=Path, help="directory to write the JSON Lines files into")
    args = parser.parse_args()
    for split, rows in convert(args.raw_dir, args.out_dir).items():
        print(f"{split}: {rows} rows -> {args.out_dir / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
