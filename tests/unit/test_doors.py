"""Each layer has one front door: its package (``lightning_gpipe.engine``), whose ``__all__`` is its face (DESIGN.md,
"Layers").

The rules, precisely:

- Through the door only: a module of the package outside a layer (``faults``, ``engine``, ``planning``,
  ``lightning``, ``hf``) imports that layer as ``from lightning_gpipe.<layer> import name``, with ``name`` in the
  face's ``__all__``: never ``from lightning_gpipe.<layer>.<module> import ...``, ``import
  lightning_gpipe.<layer>...``, nor a name the face does not list. Inside a layer its modules import each other
  directly. The two public paths that each re-export one module (:data:`PUBLIC_PATHS`: ``lightning_gpipe.skip``,
  ``lightning_gpipe.consolidate``) may import that module.
- Nothing on the face for nobody: each name of a face's ``__all__`` is imported from the face by a module outside
  its layer (the top-level package included), or is rendered in the API reference: a ``::: path`` line of
  docs/api/*.md whose path is the face or the module the face imports the name from (with no ``members:`` list, or
  one that names it), or that path and the name (``::: lightning_gpipe.hf.adapter.to_sequential``).
"""

import ast
import importlib
from pathlib import Path

from unit.test_layout import LAYERS, PACKAGE, _modules

PUBLIC_PATHS = {
    "lightning_gpipe.skip": "lightning_gpipe.engine.skip",
    "lightning_gpipe.consolidate": "lightning_gpipe.lightning.consolidate",
}
"""The public paths at the top that each re-export one module of a layer: path -> that module."""

API_PAGES = PACKAGE.parent / "docs" / "api"


def face(layer: str) -> str:
    """A layer's front door: its package."""
    return f"{PACKAGE.name}.{layer}"


def exported(layer: str) -> list[str]:
    """The names of a layer's face (``__all__``)."""
    return list(importlib.import_module(face(layer)).__all__)


def imports_past_the_door(source: str, layer: str, names: list[str], allowed: str = "") -> list[str]:
    """Where ``source`` imports ``layer`` other than through its face, whose ``__all__`` is ``names``: ``from
    lightning_gpipe.<layer>.x import ...``, ``import lightning_gpipe.<layer>...``, or a name the face does not list;
    ``from <allowed> import ...`` aside."""
    door = face(layer)

    def of_layer(module: str) -> bool:
        return module == door or module.startswith(door + ".")

    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and of_layer(node.module or "")
            and node.module != allowed
        ):
            if node.module != door:
                found.append(f"line {node.lineno}: from {node.module}")
            found += [f"line {node.lineno}: {a.name} not in __all__" for a in node.names if a.name not in names]
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if of_layer(a.name)]
    return found


def test_the_door_finder_finds_a_reach_past_it():
    source = (
        "from lightning_gpipe.engine.runtime import Runtime\n"
        "from lightning_gpipe.engine import Kind, StageSpec\n"
        "import lightning_gpipe.engine.schedule\n"
        "from lightning_gpipe.engineering import X\n"
        "from lightning_gpipe.planning.costs import CostModel\n"
    )
    assert imports_past_the_door(source, "engine", ["StageSpec"]) == [
        "line 1: from lightning_gpipe.engine.runtime",
        "line 1: Runtime not in __all__",
        "line 2: Kind not in __all__",
        "line 3: import lightning_gpipe.engine.schedule",
    ]
    assert imports_past_the_door(source, "engine", ["Kind", "StageSpec"], "lightning_gpipe.engine.runtime") == [
        "line 3: import lightning_gpipe.engine.schedule"
    ]


def _outside(layer: str) -> dict[str, Path]:
    """The package's modules outside ``layer``."""
    return {name: path for name, path in _modules().items() if name.split(".")[1:2] != [layer]}


def test_every_layer_is_imported_through_its_door_only():
    found = {}
    for layer in LAYERS:
        names = exported(layer)
        for name, path in _outside(layer).items():
            where = imports_past_the_door(path.read_text(), layer, names, PUBLIC_PATHS.get(name, ""))
            if where:
                found[f"{name} -> {layer}"] = where
    assert "lightning_gpipe.engine.pipeline" in _outside("planning")  # the finder reads the modules at all
    assert found == {}


def faces_sources(layer: str) -> dict[str, str]:
    """A face's names -> the module the face imports each from (``lightning_gpipe.faults.waiting`` for a module)."""
    source = (PACKAGE / layer / "__init__.py").read_text()
    modules = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                module = f"{node.module}.{alias.name}"
                modules[alias.asname or alias.name] = module if module in _modules() else node.module
    return modules


def rendered_paths(text: str) -> dict[str, list[str] | None]:
    """The ``:::`` lines of an API page: path -> the names of its ``members:`` list, ``None`` without one."""
    paths: dict[str, list[str] | None] = {}
    lines = text.splitlines()
    for n, line in enumerate(lines):
        if not line.startswith("::: "):
            continue
        path, members = line.split()[1], None
        for option in lines[n + 1 :]:
            if option and not option.startswith(" "):
                break
            if option.strip() == "members:":
                members = []
            elif members is not None and option.strip().startswith("- "):
                members.append(option.strip()[2:])
            elif members is not None and option.strip():
                break
        paths[path] = members
    return paths


def test_the_page_reader_finds_paths_and_members():
    text = "# X\n\n::: a.b\n    options:\n      members:\n        - c\n        - d\n      heading: 2\n\n::: a.e\ntext\n"
    assert rendered_paths(text) == {"a.b": ["c", "d"], "a.e": None}


def _rendered(name: str, door: str, module: str, pages: dict[str, list[str] | None]) -> bool:
    for path in (door, module):
        if path in pages and (pages[path] is None or name in pages[path]):
            return True
    return f"{door}.{name}" in pages or f"{module}.{name}" in pages


def test_every_name_on_a_face_is_used_by_another_layer_or_documented():
    pages: dict[str, list[str] | None] = {}
    for page in sorted(API_PAGES.glob("*.md")):
        pages.update(rendered_paths(page.read_text()))
    unused = {}
    for layer in LAYERS:
        door, sources = face(layer), faces_sources(layer)
        imported = {
            alias.name
            for path in _outside(layer).values()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == door
            for alias in node.names
        }
        names = [n for n in exported(layer) if n not in imported and not _rendered(n, door, sources[n], pages)]
        if names:
            unused[layer] = names
    assert "lightning_gpipe.planning.predict" in pages or "lightning_gpipe.planning" in pages  # the pages are read
    assert unused == {}
