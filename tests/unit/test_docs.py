"""The docs site's helper: Sphinx roles in docstrings shown as Sphinx shows them (tools/mkdocs_sphinx_roles.py); and
statements of the docs checked against the repository (the site's index, the README's order, what ran on a GPU, an
example config's comment).

The site itself is built with ``mkdocs build --strict`` in .ci/run.
"""

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from mkdocs_sphinx_roles import plain_roles  # noqa: E402


@pytest.mark.parametrize(
    ("docstring", "shown"),
    [
        (":func:`~lightning_gpipe.planning.balance.solve` chooses", "`solve()` chooses"),
        ("see :class:`lightning_gpipe.engine.runtime.Runtime`.", "see `lightning_gpipe.engine.runtime.Runtime`."),
        (":meth:`attach` and :attr:`stages`", "`attach()` and `stages`"),
        (":py:mod:`lightning_gpipe.engine.events`", "`lightning_gpipe.engine.events`"),
        (":func:`the solver <lightning_gpipe.planning.balance.solve>`", "`the solver`"),
        ("``code`` and `markdown` stay", "``code`` and `markdown` stay"),
    ],
)
def test_sphinx_roles_become_code_spans(docstring, shown) -> None:
    assert plain_roles(docstring) == shown


def _read(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def test_the_index_links_every_guide_of_the_site() -> None:
    """docs/index.md's "Where to start" links every page of the site's Guides (mkdocs.yml's nav)."""
    nav = yaml.safe_load(_read("mkdocs.yml"))["nav"]
    guides = next(entry["Guides"] for entry in nav if "Guides" in entry)
    pages = {page for guide in guides for page in guide.values()}
    linked = set(re.findall(r"\]\(([\w-]+\.md)(?:#[\w-]+)?\)", _read("docs/index.md")))
    assert pages - linked == set()


def test_the_readme_says_which_torch_build_pypi_gives_before_anything_is_installed() -> None:
    """On Linux PyPI's torch is the CUDA build: the README says so, and how to get the CPU build, before its first
    ``pip install``."""
    readme = _read("README.md")
    assert readme.index("from the public PyPI index is the CUDA build") < readme.index("pip install")
    assert readme.index("pip install") == readme.index("pip install torch==2.13.0 --index-url")


def test_the_docs_say_what_ran_on_a_gpu() -> None:
    """One-stage pipelines ran on one H100 and one H200 (docs/benchmarks.md); nothing of several GPUs (NCCL between
    stages) did. README.md and docs/scaling.md say both, and neither that the CUDA path never ran."""
    for name in ("README.md", "docs/scaling.md"):
        text = " ".join(_read(name).split())
        assert "H100" in text and "H200" in text and "NCCL between stages" in text, name
        assert not re.search(r"CUDA[^.]* (has not been run on a GPU|has not been run\.)", text), name
    assert "| H100 host |" in _read("docs/benchmarks.md") and "| H200 host |" in _read("docs/benchmarks.md")


def test_the_translation_cpu_configs_comment_names_the_decoding_it_sets() -> None:
    """examples/translation/configs/cpu.yaml's header says how its validation decodes: beam search of the width it
    sets (greedy only for a width of 1)."""
    text = _read("examples/translation/configs/cpu.yaml")
    header = " ".join(line.lstrip("# ") for line in text.split("\nseed_everything")[0].splitlines())
    beam = yaml.safe_load(text)["model"]["beam_size"]
    assert "greedy" in header if beam == 1 else f"beam {beam}" in header and "greedy" not in header
