"""Write the full Multi30k as the JSON Lines files ``--data.data_dir`` reads, so that training needs no network.

Usage (from the repository root)::

    python examples/translation/prepare.py DIR
    python examples/translation/train.py fit --config examples/translation/configs/multi30k_30min.yaml \\
        --data.data_dir=DIR

Multi30k task 1 (Elliott et al. 2016, 2017; Barrault et al. 2018; research and educational use only) is released in
the GitHub repository ``multi30k/dataset`` as one gzipped text file per split and language, aligned line by line:
``data/task1/raw/{train,val,test_2016_flickr}.{en,de,fr,cs}.gz``. This script downloads those twelve files at a fixed
commit (:data:`BASE_URL`; ``--base-url`` for another copy, ``--raw-dir`` for files already downloaded, gzipped or
not) and writes ``DIR/train.jsonl`` (29,000 rows), ``DIR/validation.jsonl`` (1,014) and
``DIR/test_2016_flickr.jsonl`` (1,000), one 4-way aligned sentence per line, ``{"id", "en", "de", "fr", "cs"}``,
with leading and trailing whitespace stripped.
"""

import argparse
import gzip
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
"""The commit of ``multi30k/dataset`` the files are read at (the shipped subset was made from it)."""

BASE_URL = f"https://raw.githubusercontent.com/multi30k/dataset/{COMMIT}/data/task1/raw"
"""Where the release's raw files are downloaded from."""

TIMEOUT = 30.0
"""Seconds a download may wait for the server."""

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


def download(raw_dir: Path, base_url: str = BASE_URL) -> None:
    """Download the release's twelve ``{split}.{language}.gz`` files from ``base_url`` into ``raw_dir``.

    Raises:
        OSError: when a file cannot be downloaded (``urllib.error.URLError`` and the like), naming it.
    """
    raw_dir.mkdir(parents=True, exist_ok=True)
    for name in SPLITS:
        for language in LANGUAGES:
            url = f"{base_url.rstrip('/')}/{name}.{language}.gz"
            try:
                with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
                    data = response.read()
            except OSError as error:
                raise OSError(f"could not download {url}: {error}") from error
            (raw_dir / f"{name}.{language}.gz").write_bytes(data)


def main(args: list[str] | None = None) -> None:
    """Parse the command line, download (unless ``--raw-dir``) and convert."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path, help="directory to write the JSON Lines files into")
    parser.add_argument("--raw-dir", type=Path, help="the release's {split}.{language}[.gz] files, already downloaded")
    parser.add_argument("--base-url", default=BASE_URL, help="where to download them from (default: the release)")
    options = parser.parse_args(args)
    with tempfile.TemporaryDirectory() as scratch:
        raw_dir = options.raw_dir
        if raw_dir is None:
            raw_dir = Path(scratch)
            try:
                download(raw_dir, options.base_url)
            except OSError as error:
                sys.exit(
                    f"error: {error}\nprepare.py downloads Multi30k from GitHub (multi30k/dataset), so it needs "
                    "network; the machine may be offline. Run it where there is network and copy DIR over, or "
                    "download the files yourself and pass --raw-dir."
                )
        elif not raw_dir.is_dir():
            sys.exit(f"error: --raw-dir={raw_dir} does not exist")
        try:
            written = convert(raw_dir, options.out_dir)
        except FileNotFoundError as error:
            sys.exit(f"error: --raw-dir={raw_dir} lacks a file of the release: {error}")
    for split, rows in written.items():
        print(f"{split}: {rows} rows -> {options.out_dir / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
