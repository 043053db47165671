"""Every table of the docs renders: README.md, CHANGELOG.md, the examples' READMEs and every page of docs/ are parsed
with the Markdown library mkdocs uses (Python-Markdown, with the extensions mkdocs.yml enables), and a block of lines
starting with ``|`` that comes out as a paragraph instead of a ``<table>`` fails, naming its file and line (a
delimiter row whose cell count differs from its header's is the usual cause; GitHub refuses such a table too)."""

import re
from pathlib import Path

import markdown
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES += sorted((ROOT / "examples").glob("*/README.md"))
DELIMITER_CELL = re.compile(r"^\s*:?-+:?\s*$")


def _site_markdown() -> markdown.Markdown:
    """A Python-Markdown converter with mkdocs.yml's ``markdown_extensions`` (the site's parser)."""
    names, configs = [], {}
    for entry in yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["markdown_extensions"]:
        name, config = next(iter(entry.items())) if isinstance(entry, dict) else (entry, None)
        names.append(name)
        if config:
            configs[name] = config
    return markdown.Markdown(extensions=names, extension_configs=configs)


def cells(row: str) -> list[str]:
    """A table row's cells: split at the ``|`` that are neither escaped nor inside a code span, as Python-Markdown's
    tables extension splits them (the outer pipes do not open cells)."""
    found, cell, code, i = [], "", 0, 0
    row = row.strip()
    while i < len(row):
        if row[i] == "\\" and i + 1 < len(row):
            cell, i = cell + row[i : i + 2], i + 2
            continue
        if row[i] == "`":
            run = len(row[i:]) - len(row[i:].lstrip("`"))
            code = 0 if code == run else (code or run)
            cell, i = cell + row[i : i + run], i + run
            continue
        if row[i] == "|" and not code:
            found.append(cell)
            cell = ""
        else:
            cell += row[i]
        i += 1
    found.append(cell)
    if row.startswith("|"):
        found = found[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        found = found[:-1]
    return found


def _why(rows: list[str]) -> str:
    if len(rows) > 1 and all(DELIMITER_CELL.match(cell) for cell in cells(rows[1])):
        header, delimiter = len(cells(rows[0])), len(cells(rows[1]))
        if header != delimiter:
            return f"its delimiter row has {delimiter} cells, its header {header}"
    return "it renders as a paragraph, not a table (is a blank line missing before it, or its delimiter row?)"


def broken_tables(text: str) -> list[tuple[int, str]]:
    """(line, why) of every block of lines starting with ``|`` that the site's parser does not make a table.

    The text goes through the parser's preprocessors (fenced code is set apart) and block parser; each paragraph
    holding such lines is one table that did not render; its line is where its ``|`` rows stand in ``text``.
    """
    md = _site_markdown()
    lines = text.split("\n")
    for preprocessor in md.preprocessors:
        lines = preprocessor.run(lines)
    source = [line.strip() for line in text.split("\n")]
    found, after = [], 0
    for paragraph in md.parser.parseDocument(lines).getroot().iter("p"):
        rows = [line.strip() for line in (paragraph.text or "").split("\n") if line.strip().startswith("|")]
        if rows:
            after = next(i for i in range(after, len(source)) if source[i : i + len(rows)] == rows) + 1
            found.append((after, _why(rows)))
    return found


GOOD = "Text.\n\n| a | b |\n| --- | ---: |\n| `x | y` | 2 |\n"
BAD_DELIMITER = "Text.\n\n| a | b |\n| --- | ---: | --- |\n| 1 | 2 |\n"
NO_BLANK_LINE = "Text.\n| a | b |\n| --- | --- |\n| 1 | 2 |\n"
IN_CODE = "```\n| a | b |\n| --- | --- | --- |\n```\n"


def test_the_checker_passes_a_table_that_renders_and_pipes_in_code() -> None:
    assert broken_tables(GOOD) == []
    assert broken_tables(IN_CODE) == []
    assert "<table>" in markdown.markdown(GOOD, extensions=["tables"])


def test_the_checker_names_the_line_of_a_table_that_does_not_render() -> None:
    assert broken_tables(BAD_DELIMITER) == [(3, "its delimiter row has 3 cells, its header 2")]
    assert broken_tables(BAD_DELIMITER + "\n" + GOOD + "\n" + BAD_DELIMITER) == [
        (3, "its delimiter row has 3 cells, its header 2"),
        (15, "its delimiter row has 3 cells, its header 2"),
    ]
    assert [line for line, _ in broken_tables(NO_BLANK_LINE)] == [2]


def test_cells_split_as_the_tables_extension_does() -> None:
    assert cells("| a | `b | c` | d \\| e |") == [" a ", " `b | c` ", " d \\| e "]
    assert len(cells("| --- | ---: | :--- |")) == 3


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_renders(page: Path) -> None:
    broken = broken_tables(page.read_text(encoding="utf-8"))
    assert broken == [], "\n".join(f"{page.relative_to(ROOT)}:{line}: {why}" for line, why in broken)
