"""The installed distribution's metadata: license, classifiers, project URLs, declared dependencies, version, py.typed.

These read the metadata of the installed ``lightning-gpipe`` (``importlib.metadata``). Under an editable install that
metadata is the one written by the last ``pip install -e``: after changing ``pyproject.toml``, reinstall
(``pip install --no-deps -e .``); :func:`test_installed_metadata_is_current` says so when it was not done.
"""

import ast
import importlib.metadata
import importlib.resources
import re
import sys
from pathlib import Path

import pytest

import lightning_gpipe

DISTRIBUTION = "lightning-gpipe"
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_gpipe"

# Import names whose distribution is not the import name normalised (PEP 503); the others map to themselves,
# e.g. ``lightning`` -> ``lightning``, ``typing_extensions`` -> ``typing-extensions``.
DISTRIBUTION_OF_IMPORT = {"PIL": "pillow", "yaml": "pyyaml", "sklearn": "scikit-learn"}

URLS = {"Homepage", "Documentation", "Source", "Issues", "Changelog"}


def normalise(name: str) -> str:
    """A distribution name in PEP 503 normal form."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_of(module: str) -> str:
    return normalise(DISTRIBUTION_OF_IMPORT.get(module, module))


@pytest.fixture(scope="module")
def metadata():
    return importlib.metadata.metadata(DISTRIBUTION)


def requirements(metadata) -> list[tuple[str, str, str]]:
    """``(normalised name, specifiers, marker)`` of each ``Requires-Dist``; the marker is ``""`` for a base one."""
    return parse_requirements(metadata.get_all("Requires-Dist") or [])


def parse_requirements(lines: list[str]) -> list[tuple[str, str, str]]:
    parsed = []
    for line in lines:
        requirement, _, marker = line.partition(";")
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)", requirement)
        assert match, line
        specifiers = ",".join(sorted(s.strip() for s in match.group(3).strip("() ").split(",") if s.strip()))
        parsed.append((normalise(match.group(1)), specifiers, marker.strip()))
    return parsed


class _Imports(ast.NodeVisitor):
    """Top-level names of the absolute imports of one module, split by whether importing the module runs them.

    Imports in a ``try:`` whose ``except`` catches ``ImportError`` have a fallback, so need no declaration: skipped.
    """

    def __init__(self) -> None:
        self.eager: set[str] = set()  # run when the module is imported
        self.deferred: set[str] = set()  # in a function, or under ``if TYPE_CHECKING:``
        self._depth = 0
        self._optional = 0

    def _add(self, name: str) -> None:
        if not self._optional:
            (self.deferred if self._depth else self.eager).add(name.split(".")[0])

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module)

    def _deferred(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _deferred

    def visit_Try(self, node: ast.Try) -> None:
        caught = set()
        for handler in node.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        optional = bool(caught & {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"})
        self._optional += optional
        for child in node.body:
            self.visit(child)
        self._optional -= optional
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    visit_TryStar = visit_Try

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        if name == "TYPE_CHECKING":
            self._depth += 1
            for child in node.body:
                self.visit(child)
            self._depth -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)


def third_party_imports() -> tuple[set[str], set[str]]:
    """Third-party top-level import names of ``lightning_gpipe/**/*.py``: (imported eagerly, imported only later)."""
    eager: set[str] = set()
    deferred: set[str] = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        imports = _Imports()
        imports.visit(ast.parse(path.read_text(), filename=str(path)))
        eager |= imports.eager
        deferred |= imports.deferred
    ours = {"lightning_gpipe", "__future__"} | set(sys.stdlib_module_names)
    eager -= ours
    return eager, deferred - ours - eager


def test_the_import_scan_tells_eager_deferred_and_optional_imports_apart():
    source = """
import a.b
from c import d
from . import relative
if TYPE_CHECKING:
    from e import F
try:
    import g
except ImportError:
    g = None
def h():
    import i
"""
    imports = _Imports()
    imports.visit(ast.parse(source))
    assert (imports.eager, imports.deferred) == ({"a", "c"}, {"e", "i"})


def test_the_import_scan_finds_the_known_imports():
    eager, deferred = third_party_imports()
    assert {"torch", "lightning", "typing_extensions"} <= eager
    assert "matplotlib" in deferred  # draw_timeline imports it when called; the ``timeline`` extra declares it


def test_every_eager_third_party_import_is_a_base_dependency(metadata):
    base = {name for name, _, marker in requirements(metadata) if not marker}
    eager, _ = third_party_imports()
    missing = {module: distribution_of(module) for module in eager if distribution_of(module) not in base}
    assert not missing, f"imported by lightning_gpipe but not in [project] dependencies: {missing}"


def test_every_deferred_third_party_import_is_declared_at_least_in_an_extra(metadata):
    declared = {name for name, _, _ in requirements(metadata)}
    _, deferred = third_party_imports()
    missing = {module: distribution_of(module) for module in deferred if distribution_of(module) not in declared}
    assert not missing, f"imported by lightning_gpipe but declared nowhere, not even in an extra: {missing}"


def test_every_base_dependency_is_imported(metadata):
    eager, deferred = third_party_imports()
    imported = {distribution_of(module) for module in eager | deferred}
    unused = {name for name, _, marker in requirements(metadata) if not marker} - imported
    assert not unused, f"[project] dependencies that lightning_gpipe does not import: {unused}"


def test_the_import_name_mapping_agrees_with_the_installed_distributions():
    provided_by = importlib.metadata.packages_distributions()
    eager, deferred = third_party_imports()
    for module in sorted(eager | deferred):
        if module in provided_by:  # an extra's package may not be installed
            assert distribution_of(module) in {normalise(d) for d in provided_by[module]}, module


def test_license(metadata):
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "LICENSE" in (metadata.get_all("License-File") or [])
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_classifiers(metadata):
    classifiers = set(metadata.get_all("Classifier") or [])
    assert "Typing :: Typed" in classifiers
    assert "Topic :: Scientific/Engineering :: Artificial Intelligence" in classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    versions = sorted(
        tuple(int(part) for part in c.rsplit(" ", 1)[1].split("."))
        for c in classifiers
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert versions == [(3, minor) for minor in range(10, 14)]
    assert metadata["Requires-Python"] == ">=3.10"  # the oldest Python classifier
    # PEP 639: the license expression replaces the license classifiers (setuptools rejects both)
    assert not any(c.startswith("License :: ") for c in classifiers)


def test_project_urls(metadata):
    urls = dict(line.split(", ", 1) for line in metadata.get_all("Project-URL") or [])
    assert set(urls) == URLS
    assert all(url.startswith("https://") for url in urls.values())
    assert urls["Source"] == "https://github.com/lightning-gpipe/lightning-gpipe"


def test_py_typed_is_in_the_package():
    assert importlib.resources.files("lightning_gpipe").joinpath("py.typed").is_file()
    files = importlib.metadata.files(DISTRIBUTION) or []
    installed = [f for f in files if f.parts[0] == "lightning_gpipe"]
    if installed:  # a regular install lists the package's files (an editable one lists only its finder)
        assert any(f.name == "py.typed" for f in installed)


def test_version_is_the_metadata_version():
    assert lightning_gpipe.__version__ == importlib.metadata.version(DISTRIBUTION)


def test_installed_metadata_is_current(metadata):
    """The metadata agrees with ``pyproject.toml`` (it does not after an edit without reinstalling)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not run from a source tree")
    project = tomllib.loads(pyproject.read_text())
    stale = "the installed metadata is stale: run `pip install --no-deps -e .`"
    base = sorted(r for r in requirements(metadata) if not r[2])
    assert base == sorted(parse_requirements(project["project"]["dependencies"])), stale
    assert set(metadata.get_all("Classifier") or []) == set(project["project"]["classifiers"]), stale
    # one version source: pyproject.toml reads it from lightning_gpipe/__init__.py
    assert "version" in project["project"]["dynamic"] and "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_gpipe.__version__"}
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["lightning_gpipe"]
