"""A griffe extension for the docs site: Sphinx cross-reference roles in docstrings become code spans.

The docstrings of ``lightning_gpipe`` name other objects the Sphinx way
(``:func:`~lightning_gpipe.planning.balance.solve```), which Markdown would print as is. Loaded by mkdocstrings
(``extensions`` in ``mkdocs.yml``), this rewrites each role to a code span as Sphinx shows it:
``:func:`~a.b.solve``` -> ```solve()```, ``:class:`a.b.Stage``` -> ```a.b.Stage```, ``:func:`title <a.b.c>``` ->
```title```. Docstrings keep working for Sphinx and ``help()``; only the site's copy
changes.
"""

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(func|meth|class|mod|attr|data|exc|obj|const|term|ref):`([^`]+)`")
"""A Sphinx role with its target: ``:kind:`target```."""


def _shown(match: re.Match) -> str:
    """The code span Sphinx would show for one role."""
    kind, target = match.groups()
    titled = re.fullmatch(r"(.+?)\s*<([^>]+)>", target)
    if titled:
        return f"`{titled.group(1)}`"
    text = target.lstrip("~").lstrip(".")
    if target.startswith("~"):
        text = text.rsplit(".", 1)[-1]
    return f"`{text}()`" if kind in ("func", "meth") else f"`{text}`"


def plain_roles(text: str) -> str:
    """``text`` with every Sphinx cross-reference role replaced by the code span it shows."""
    return ROLE.sub(_shown, text)


class SphinxRoles(Extension):
    """Rewrite the Sphinx roles of every loaded object's docstring (see :func:`plain_roles`)."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)
