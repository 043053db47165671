"""The docs site's helper: Sphinx roles in docstrings shown as Sphinx shows them (tools/mkdocs_sphinx_roles.py).

The site itself is built with ``mkdocs build --strict`` in .ci/run.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

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
