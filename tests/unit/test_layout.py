"""The package's layout: folders by concern, imports one way between them, small functions and classes."""

import ast
import inspect
import re
from pathlib import Path

import pytest

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


LAYERS = ("faults", "engine", "planning", "lightning", "hf", "timm", "litgpt")
"""The package's folders, bottom to top: a module imports only from its own folder and the folders below it. The
adapters (:data:`ADAPTERS`) share the top: none imports another."""

ADAPTERS = ("hf", "timm", "litgpt")
"""The folders that each bring one library's models (transformers, timm, litgpt) to the layers below them."""

FACADES = {"lightning_gpipe", "lightning_gpipe.skip", "lightning_gpipe.consolidate"}
"""The public paths at the top (``import lightning_gpipe``, ``lightning_gpipe.skip``, ``python -m
lightning_gpipe.consolidate``): they re-export, and may import from any folder."""

FLOOR = "lightning_gpipe._torch"
"""The floor under the folders (torch's private API, in one module): it imports nothing of the package, and every
folder may import it."""


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return -1
    return LAYERS.index(ADAPTERS[0]) if parts[1] in ADAPTERS else LAYERS.index(parts[1])


def _adapter(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ADAPTERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of a module from a folder above its own, and every module outside the folders and the
    facades (it would have no place in the rule)."""
    found = []
    for module, targets in graph.items():
        if module in FACADES:
            continue
        if module == FLOOR:
            found += [(module, target) for target in sorted(targets)]
            continue
        if _layer(module) < 0:
            found.append((module, "(no folder)"))
        found += [(module, target) for target in sorted(targets) if _layer(target) > _layer(module)]
        if _adapter(module) is not None:  # the adapters share the top: none imports another
            others = [target for target in sorted(targets) if _adapter(target) not in (None, _adapter(module))]
            found += [(module, target) for target in others]
    return found


def test_the_package_imports_one_way():
    graph = import_graph()
    assert "lightning_gpipe.engine.model_chunk" in graph["lightning_gpipe.engine.pipeline"]  # the graph is read at all
    assert cycles(graph) == []
    assert upward_imports(graph) == []


def test_the_rule_finds_an_upward_import():
    graph = {"lightning_gpipe.engine.a": {"lightning_gpipe.planning.b"}, "lightning_gpipe.planning.b": set()}
    assert upward_imports(graph) == [("lightning_gpipe.engine.a", "lightning_gpipe.planning.b")]


def test_the_rule_finds_an_adapter_importing_another_and_lets_it_import_the_layers_below():
    graph = {
        "lightning_gpipe.timm.a": {"lightning_gpipe.hf.b", "lightning_gpipe.lightning.c", "lightning_gpipe.timm.d"},
        "lightning_gpipe.hf.b": {"lightning_gpipe.lightning.c"},
    }
    assert upward_imports(graph) == [("lightning_gpipe.timm.a", "lightning_gpipe.hf.b")]


def test_the_rule_lets_every_folder_import_the_floor_and_the_floor_nothing():
    graph = {"lightning_gpipe.faults.a": {FLOOR}, FLOOR: {"lightning_gpipe.faults.a"}}
    assert upward_imports(graph) == [(FLOOR, "lightning_gpipe.faults.a")]


def _imports_lightning(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if any(n == "lightning" or n.startswith(("lightning.", "pytorch_lightning")) for n in names):
            return True
    return False


def test_only_the_adapter_and_hf_import_lightning():
    importers = {name for name, path in _modules().items() if _imports_lightning(path)}
    assert "lightning_gpipe.lightning.strategy" in importers  # the finder finds them at all
    below = {name for name in importers if _layer(name) < LAYERS.index("lightning") and name not in FACADES}
    assert below == set()


def test_the_package_has_few_entries_at_its_top():
    """The folders (four layers and the adapters), the two public paths besides ``__init__.py``, the floor and
    ``py.typed``."""
    entries = {path.name for path in PACKAGE.iterdir() if path.name not in ("__init__.py", "__pycache__")}
    assert len(entries) <= len(LAYERS) + 4, sorted(entries)


def long_definitions(source: str, function_lines: int = 60, class_lines: int = 300) -> list[str]:
    """The functions longer than ``function_lines`` and the classes longer than ``class_lines`` of ``source``
    (their docstrings included), as ``"name: lines"``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        limit = class_lines if isinstance(node, ast.ClassDef) else function_lines
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{node.name}: {lines}")
    return found


def test_the_length_finder_finds_a_long_function():
    assert long_definitions("def f():\n" + "    x = 1\n" * 61) == ["f: 62"]


def test_no_function_is_over_60_lines_and_no_class_over_300():
    found = {name: long_definitions(path.read_text()) for name, path in _modules().items()}
    assert {name: where for name, where in found.items() if where} == {}


def test_the_partition_knows_nothing_of_the_rest_of_the_engine():
    engine = {
        "lightning_gpipe.engine.model_chunk",
        "lightning_gpipe.engine.schedule",
        "lightning_gpipe.engine.pipeline",
        "lightning_gpipe.lightning.contract",
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
    """The failure board, the position, the watchdog and the waiter are one run's
    (:class:`lightning_gpipe.faults.job.Job`):
    no module keeps state in module-level or class-level variables. The one process-wide state, chosen and documented,
    is the device meshes a process made (``engine/topology.py`` ``_MESHES``, filled through a local name), as
    torch.distributed's default process group is process-wide."""
    found = {name: mutable_globals(path.read_text()) for name, path in _modules().items()}
    assert {name: where for name, where in found.items() if where} == {}


def listed_modules(text: str) -> set[str]:
    """The modules a layout block lists, as paths under the package (``engine/skip/links.py``): the block of
    ``text`` that starts at a line ``lightning_gpipe/`` and runs while lines are indented; a line whose first word
    is a folder (``engine/``) opens it at that indentation, a line whose first words are modules (``x.py``) lists
    them in the folder it is indented under."""
    lines = text.splitlines()
    start = lines.index("lightning_gpipe/") + 1
    folders: list[str] = []
    found = set()
    for line in lines[start:]:
        if not line.startswith("  "):
            break
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        words = line.split()
        if words[0].endswith("/"):
            folders = folders[:depth] + [words[0]]
            continue
        modules = words[: next((n for n, word in enumerate(words) if not word.endswith(".py")), len(words))]
        found |= {"".join(folders[:depth]) + module for module in modules}
    return found


def test_the_layout_finder_reads_a_tree():
    text = "x\nlightning_gpipe/\n  a.py  b.py   text\n  f/        text\n    c.py  the c\n      more text\n  d.py\nend"
    assert listed_modules(text) == {"a.py", "b.py", "f/c.py", "d.py"}


@pytest.mark.parametrize("document", ["docs/how-it-works.md", "README.md"])
def test_the_module_maps_name_every_module(document):
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}
    modules -= {m for m in modules if m.endswith("/__init__.py")}  # a folder's line stands for its __init__
    assert listed_modules((PACKAGE.parent / document).read_text()) == modules


LIGHTNING_API = {
    "LightningModule",
    "LightningDataModule",
    "Trainer",
    "trainer",
    "Callback",
    "training_step",
    "validation_step",
    "test_step",
    "predict_step",
    "automatic_optimization",
    "manual_backward",
    "log_dict",
    "fit_loop",
    "lightning",
    "lightning_utilities",
    "pytorch_lightning",
}
"""Names of Lightning's API (its classes, hooks, attributes and packages) that only the adapter may name."""


def code_words(node: ast.AST) -> list[str]:
    """The names ``node`` writes in code: an identifier, an attribute, an argument, or the dotted parts of an import's
    names and module; none for any other node."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [part for alias in node.names for part in alias.name.split(".")] + (
            getattr(node, "module", None) or ""
        ).split(".")
    return []


def lightning_names(source: str) -> list[str]:
    """Where ``source``'s code names Lightning's API: an identifier, attribute, argument, import or string constant
    (a message, a ``getattr`` name) that is, or whose dotted parts include, one of :data:`LIGHTNING_API`. Docstrings
    and comments are prose and may explain what the adapter does with a value."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        words = code_words(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = [w.strip("`'\"().,:;") for w in node.value.replace(".", " ").split()]
        found += [f"line {node.lineno}: {word}" for word in words if word in LIGHTNING_API]
    return found


def test_the_name_finder_finds_lightning_in_code_not_in_prose():
    source = (
        '"""Runs training_step."""\ndef f(module):\n    """The trainer\'s."""\n'
        '    return module.trainer, "`training_step` failed"\n'
    )
    assert lightning_names(source) == ["line 4: trainer", "line 4: training_step"]


def test_the_engine_planning_and_faults_never_name_lightning():
    below = {name: path for name, path in _modules().items() if 0 <= _layer(name) < LAYERS.index("lightning")}
    assert "lightning_gpipe.engine.pipeline" in below  # the finder reads the lower layers at all
    found = {name: lightning_names(path.read_text()) for name, path in below.items()}
    assert {name: where for name, where in found.items() if where} == {}


def test_the_engine_api_page_shows_its_door_and_names_every_exported_name():
    """docs/api/engine.md renders the engine's front door only (its internals are not API) and names every name
    of ``lightning_gpipe.engine.__all__``."""
    import lightning_gpipe.engine as face

    text = (PACKAGE.parent / "docs" / "api" / "engine.md").read_text()
    rendered = {line.split()[1] for line in text.splitlines() if line.startswith(":::")}
    assert rendered == {"lightning_gpipe.engine.pipeline"}
    assert [name for name in face.__all__ if f"`{name}`" not in text] == []


def adapter_keywords(lower: list[str]) -> set[str]:
    """The keywords of ``GPipeStrategy(...)`` and ``Trainer(...)`` that are the adapter's alone: all but those that
    ``lower`` (the sources of engine/, planning/ and faults/) define as terms of their own, a function's parameter or
    a class's field (``balance``, ``schedule``, the planner's ``pipeline_parallel_size``, the engine's ``compile``...),
    which those layers may name in their messages."""
    from lightning.pytorch import Trainer

    from lightning_gpipe import GPipeStrategy

    keywords = {*inspect.signature(GPipeStrategy.__init__).parameters, *inspect.signature(Trainer.__init__).parameters}
    own = set()
    for node in (node for source in lower for node in ast.walk(ast.parse(source))):
        if isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.ClassDef):
            own |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return keywords - own - {"self"}


def lightning_steps() -> set[str]:
    """Lightning's step names: the methods of ``LightningModule`` named ``*_step`` (``training_step``,
    ``optimizer_step``...)."""
    from lightning.pytorch import LightningModule

    return {
        name for name in dir(LightningModule) if name.endswith("_step") and callable(getattr(LightningModule, name))
    }


def adapter_terms(source: str, keywords: set[str], steps: set[str]) -> list[str]:
    """Where ``source`` names the adapter's terms: ``GPipeStrategy``, ``Trainer`` or one of ``steps`` as an
    identifier, attribute, argument or import, or as a word of a string constant (a message, an annotation); and in
    a string constant, one of ``keywords`` written as a keyword argument (``compile=``), or one with an underscore
    (``stall_timeout``: no English word) anywhere. Prose may name them: comments, and docstrings (every string
    statement: a module's, a class's, a function's or an attribute's)."""
    names = {"GPipeStrategy", "Trainer"} | steps
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    written = "|".join(sorted(keywords, key=len, reverse=True)) or "(?!)"
    compound = "|".join(sorted((k for k in keywords if "_" in k), key=len, reverse=True)) or "(?!)"
    said = re.compile(rf"(?<![\w.])(?:({written})=(?!=)|({compound})(?!\w))")
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        words = code_words(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            words = re.findall(r"\w+", node.value)
            keys = [f"{m[1]}=" if m[1] else m[2] for m in said.finditer(node.value)]
            found += [(node.lineno, key) for key in dict.fromkeys(keys)]
        found += [(node.lineno, word) for word in dict.fromkeys(words) if word in names]
    return [f"line {line}: {word}" for line, word in sorted(found)]


def test_the_adapter_term_finder_finds_the_strategy_its_keywords_and_a_step_in_code_not_in_prose():
    source = (
        '"""Checks GPipeStrategy(compile=...) for training_step."""\n'
        'LIMIT = 1\n"""As stall_timeout says."""\n'
        'def f(value, strategy: "GPipeStrategy", balance=2):\n'
        "    # GPipeStrategy(compile=...)\n"
        '    if value == "compile" or value == "balance":\n'
        '        raise ValueError(f"compile={value!r}, balance={balance}: raise stall_timeout; compile == 1")\n'
        "    return strategy.training_step, GPipeStrategy\n"
    )
    found = adapter_terms(
        source, adapter_keywords([source]) & {"compile", "stall_timeout", "balance"}, {"training_step"}
    )
    assert found == [
        "line 4: GPipeStrategy",
        "line 7: compile=",
        "line 7: stall_timeout",
        "line 8: GPipeStrategy",
        "line 8: training_step",
    ]


def test_the_engine_planning_and_faults_name_no_option_of_the_strategy_or_the_trainer():
    """The layers below the adapter check values and word errors in their own terms; what names a ``GPipeStrategy``
    or ``Trainer`` keyword, or Lightning's steps, lives in lightning/ (which words the fix around their errors)."""
    below = {
        name: path.read_text() for name, path in _modules().items() if 0 <= _layer(name) < LAYERS.index("lightning")
    }
    keywords = adapter_keywords(list(below.values()))
    assert {"chunks", "stall_timeout", "devices"} <= keywords and not {"balance", "compile"} & keywords  # their own
    found = {name: adapter_terms(source, keywords, lightning_steps()) for name, source in below.items()}
    assert {name: where for name, where in found.items() if where} == {}
