"""The package's layout: its modules import each other one way only."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_gpipe"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its code (deferred imports included).

    ``from a.b import c`` imports ``a.b.c`` when that is a module, else ``a.b``; importing ``a.b.c`` also runs
    the ``__init__`` of the subpackage ``a.b`` (but the root package's, which every module has, is left out).
    """
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE.name):
                submodules = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [m for m in submodules if m in modules]
                if len(targets) < len(submodules):
                    targets.append(node.module)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith(PACKAGE.name)]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for end in range(2, len(parts) + 1):
                    imported = ".".join(parts[:end])
                    if imported in modules and imported != name and not name.startswith(imported + "."):
                        graph[name].add(imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle found by a depth-first search, as the list of modules around it."""
    found, state, path = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                found.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_package_imports_one_way():
    graph = import_graph()
    assert "lightning_gpipe.engine.model_chunk" in graph["lightning_gpipe.engine.runtime"]  # the graph is read at all
    assert cycles(graph) == []


def test_the_partition_knows_nothing_of_the_engine():
    engine = {
        "lightning_gpipe.engine.model_chunk",
        "lightning_gpipe.engine.schedule",
        "lightning_gpipe.engine.runtime",
        "lightning_gpipe.engine.contract",
        "lightning_gpipe.planning.balance",
    }
    assert import_graph()["lightning_gpipe.engine.partition"].isdisjoint(engine)


def mutable_globals(source: str) -> list[str]:
    """Where ``source`` keeps process-wide state: ``global`` statements, assignments to an attribute of one of its
    module-level classes (or of ``cls``), and item assignments to a module-level name."""
    tree = ast.parse(source)
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)} | {"cls"}
    names = {
        t.id
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id in classes:
                    found.append(f"line {node.lineno}: {part.value.id}.{part.attr} assigned")
                if isinstance(part, ast.Subscript) and isinstance(part.value, ast.Name) and part.value.id in names:
                    found.append(f"line {node.lineno}: {part.value.id}[...] assigned")
    return found


def test_the_finder_of_process_wide_state_finds_it():
    source = """
class _Board:
    name = "stage 0"
_waiter = None
_seen = {}
def attach(name):
    global _waiter
    _Board.name = name
    _seen[name] = True
class Board:
    @classmethod
    def attach(cls, name):
        cls.name = name
"""
    assert len(mutable_globals(source)) == 4


def test_the_engine_keeps_no_process_wide_state():
    """The failure board, the position, the watchdog and the waiter are one run's (:class:`lightning_gpipe.faults.job.Job`):
    no module keeps state in module-level or class-level variables."""
    found = {name: mutable_globals(path.read_text()) for name, path in _modules().items()}
    assert {name: where for name, where in found.items() if where} == {}
