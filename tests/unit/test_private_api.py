"""Only ``lightning_gpipe/lightning/_lightning.py`` (the shim) touches Lightning's private API (DESIGN.md, "Layers"),
and only ``lightning_gpipe/_torch.py`` (the torch shim) touches torch's.

Lightning may change a private name in any release; with every use in one module, each with why and the versions
it was checked on, an upgrade is one file to read. The scan fails naming each place where another module of the
package touches one. The rule, precisely:

(a) Private imports: no ``import`` or ``from ... import`` of a Lightning package (:data:`LIGHTNING_PACKAGES`) names a
    private module or name, a dotted part of the module path or an imported name with a leading underscore that is
    not a dunder (``from lightning.fabric.utilities.seed import _set_rng_states``; ``__version__`` is public).
(b) Lightning's private attributes: no attribute ``<expr>._x`` (one leading underscore, not a dunder), and no string
    that is exactly such a name (``getattr(closure, "_result")``, a tuple of field names), where ``_x`` is one of
    Lightning's names and not one of the package's own:

    - Lightning's names (:func:`lightning_names`) are those the installed ``lightning`` package's source binds: a
      ``def`` or ``class`` at module or class level, an assignment or annotation to a name at module or class level,
      and an assignment to an attribute of anything, anywhere (``self._x = ...``, ``loop._x = ...``).
    - The package's own names (:func:`own_names`) are those its source, less the shim, binds: a ``def`` or ``class``
      at module or class level, an assignment or annotation to a name at module or class level, and an assignment to
      an attribute of ``self`` or ``cls``. An assignment to an attribute of another object
      (``trainer.fit_loop._x = f``) patches that object and binds nothing of the package's; imports bind nothing of
      their own. A name the package binds in a Lightning subclass that Lightning binds there too (rule (c)) is
      Lightning's.
    - A name both Lightning and the package bind otherwise (``_run``, ``_device``) counts as the package's: the scan
      cannot tell whose object ``obj._run`` is. Rule (c) covers the case where it can: ``self`` in a Lightning
      subclass.
    - torch's private names are rules (d) to (f)'s, other libraries' are the package's to use, unless Lightning
      binds them too; the few of those where the package means torch's are listed in :data:`TORCH_NAMES`, with the
      attribute they are.
(c) Lightning classes from the inside: a class of the package derived from a Lightning class (a strategy, a
    ``LightningModule``, a callback) neither binds (``def``, class attribute, assignment to ``self._x`` or
    ``cls._x``) nor reads through ``self`` or ``cls`` a private name that a Lightning class of its MRO binds in its
    own source: an override of a private hook (``Strategy._configure_launcher``), a private attribute of the base
    (``self._launcher``, ``LightningModule._trainer``, ``ModelSummary._max_depth``). The package's other classes
    in its MRO (mixins such as ``CheckpointHooks``) count as its body; the shim's classes (``LaunchedParallelStrategy``)
    are skipped, their Lightning bases are not.

The shim's public names each say in their docstring on which Lightning versions they were checked ("Checked on:
lightning X.Y.Z, ..."), every version within the ``lightning`` requirement of ``pyproject.toml``.

torch's private API, likewise, as far as an AST scan can tell, outside the torch shim:

(d) Private imports: no ``import`` or ``from ... import`` of ``torch`` names a private module or name (as (a):
    ``from torch.utils._pytree import tree_flatten``).
(e) Private chains: no attribute chain that starts at a name the module imported from torch (``torch``, ``dist``,
    ``nn``, ``F``) has a private part (``torch._functorch.config``, ``dist.distributed_c10d._get_default_store``).
(f) torch's private attributes: no attribute ``<expr>._x`` and no string that is exactly ``_x`` (``getattr(module,
    "_reset_parameters")``) where ``_x`` is torch's (:func:`torch_names`): a name torch's Python source binds on an
    object (an assignment to an attribute of anything, ``self._modules = ...``, or a method, ``def _lazy_init(self``)
    or an autograd node's saved value (``_saved_mat1``, bound in C++); but not one the package's own classes bind
    (:func:`own_attributes`: on the class, or on ``self`` or ``cls``; the scan cannot tell whose ``obj._x`` is), and
    not one Lightning binds too (rule (b)'s), unless :data:`TORCH_NAMES` lists it. So an override of a private hook
    of a torch class (``_check_input_dim`` of the batch-norm base) reads as the package's own name.

The torch shim's public names say why and on which torch versions they were checked ("Checked on: torch X.Y.Z"),
each within the ``torch`` requirement of ``pyproject.toml``, which stays below torch's next minor release.
"""

import ast
import importlib
import inspect
import pkgutil
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import lightning
import torch
from lightning.pytorch.strategies import ParallelStrategy
from packaging.requirements import Requirement
from packaging.version import Version

import lightning_gpipe

PACKAGE = Path(lightning_gpipe.__file__).resolve().parent
SHIM = PACKAGE / "lightning" / "_lightning.py"
SHIM_MODULE = "lightning_gpipe.lightning._lightning"

LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")
"""Lightning's importable packages: the unified one and the two standalone ones it mirrors."""

TORCH_NAMES = {
    "_modules": "torch.nn.Module._modules, a module's children by name (Lightning binds it on a helper of its own, "
    "lightning/fabric/plugins/precision/utils.py)",
    "_version": "torch.Tensor._version, a tensor's in-place version counter (Lightning binds a module's _version)",
    "_forward_hooks": "torch.nn.Module._forward_hooks, a module's forward hooks by id (Lightning's DeepSpeed strategy"
    " resets them)",
    "_forward_pre_hooks": "torch.nn.Module._forward_pre_hooks, a module's forward-pre hooks by id (likewise)",
}
"""Private names Lightning binds too, which the package uses as torch's: name -> the torch attribute it is."""

CHECKED = re.compile(r"Checked on: lightning (\d+\.\d+\.\d+(?:, \d+\.\d+\.\d+)*)")
"""The line each of the shim's public names carries: the Lightning versions it was checked on."""


def is_private(name: str) -> bool:
    """Whether ``name`` has a leading underscore and is not a dunder (nor ``_`` alone)."""
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def _is_lightning_module(module: str) -> bool:
    return module.split(".")[0] in LIGHTNING_PACKAGES


def bindings(tree: ast.AST, owners: frozenset[str] | None = None) -> dict[str, int]:
    """The private names ``tree`` binds, each with the line of its first binding: ``def`` and ``class`` at module or
    class level, assignments and annotations to names at module or class level, and assignments to attributes
    anywhere (of any object, or with ``owners`` only of those names, e.g. ``self`` and ``cls``)."""
    found: dict[str, int] = {}

    def targets(target: ast.AST, top: bool) -> Iterator[str]:
        if isinstance(target, ast.Name) and top:
            yield target.id
        elif isinstance(target, ast.Attribute):
            if owners is None or (isinstance(target.value, ast.Name) and target.value.id in owners):
                yield target.attr
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                yield from targets(element, top)
        elif isinstance(target, ast.Starred):
            yield from targets(target.value, top)

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and top:
                names.append(child.name)
            if isinstance(child, ast.Assign):
                names += [name for target in child.targets for name in targets(target, top)]
            elif isinstance(child, (ast.AnnAssign, ast.AugAssign)):
                names += targets(child.target, top)
            for name in names:
                if is_private(name):
                    found.setdefault(name, child.lineno)
            scope = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            visit(child, isinstance(child, ast.ClassDef) or (top and not isinstance(child, scope)))

    visit(tree, True)
    return found


@cache
def lightning_names() -> frozenset[str]:
    """The private names the installed ``lightning`` package's source binds (see :func:`bindings`)."""
    root = Path(lightning.__file__).parent
    return frozenset(name for path in root.rglob("*.py") for name in bindings(ast.parse(path.read_bytes())))


def _package_files() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path != SHIM and "__pycache__" not in path.parts)


def _relative(path: Path | str) -> str:
    return str(Path(path).resolve().relative_to(PACKAGE))


# ------------------------------------------------------------------------------------------- (c): subclasses


def _is_lightning_class(cls: type) -> bool:
    return _is_lightning_module(getattr(cls, "__module__", "") or "")


def _is_package_class(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module.startswith(f"{lightning_gpipe.__name__}.") and module != SHIM_MODULE


@cache
def _class_bindings(cls: type) -> frozenset[str]:
    """The private names ``cls``'s own source binds on the class or its instances."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (a class made at run time, or in C)
        return frozenset()
    return frozenset(bindings(ast.parse(source), frozenset({"self", "cls"})))


def subclass_uses(cls: type, ours: Callable[[type], bool] = _is_package_class) -> dict[tuple[str, int, str], str]:
    """Rule (c) for one class: (path, line, name) -> what the classes of ``cls``'s MRO that ``ours`` accepts do
    with a private name the Lightning classes of its MRO bind; empty for a class not derived from Lightning's."""
    lightning_bases = [base for base in cls.__mro__ if _is_lightning_class(base)]
    theirs = frozenset().union(*(_class_bindings(base) for base in lightning_bases))
    found: dict[tuple[str, int, str], str] = {}
    for mine in [base for base in cls.__mro__ if ours(base)] if lightning_bases else []:
        lines, start = inspect.getsourcelines(mine)
        tree = ast.parse(textwrap.dedent("".join(lines)))
        path = inspect.getsourcefile(mine)
        for name, line in bindings(tree, frozenset({"self", "cls"})).items():
            if name in theirs:
                found[(path, start + line - 1, name)] = f"{mine.__name__} binds {name}"
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls")
                and node.attr in theirs
            ):
                found.setdefault((path, start + node.lineno - 1, node.attr), f"{mine.__name__} reads {node.attr}")
    base_names = ", ".join(base.__name__ for base in lightning_bases[:2])
    return {key: f"{what}, private to Lightning's {base_names}" for key, what in found.items()}


@cache
def package_subclass_uses() -> dict[tuple[str, int, str], str]:
    """Rule (c) over every class the package's modules define (but the shim's)."""
    found: dict[tuple[str, int, str], str] = {}
    for info in pkgutil.walk_packages(lightning_gpipe.__path__, f"{lightning_gpipe.__name__}."):
        if info.name == SHIM_MODULE:
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError as error:  # an optional dependency; (a) and (b) still read its source
            if (error.name or "").startswith(lightning_gpipe.__name__):
                raise
            continue
        for cls in vars(module).values():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                found.update(subclass_uses(cls))
    return found


# ---------------------------------------------------------------------------------------- (a) and (b): names


@cache
def own_names() -> frozenset[str]:
    """The package's own private names (see the module docstring, (b)), less those rule (c) finds it binding."""
    self_or_cls = frozenset({"self", "cls"})
    owned = {name for path in _package_files() for name in bindings(ast.parse(path.read_bytes()), self_or_cls)}
    return frozenset(owned - {name for _, _, name in package_subclass_uses()})


def _lightnings(name: str, own: frozenset[str]) -> bool:
    return is_private(name) and name in lightning_names() and name not in own and name not in TORCH_NAMES


def source_uses(source: str | bytes, own: frozenset[str]) -> list[tuple[int, str, str]]:
    """Rules (a) and (b) for one module's source: (line, name, what) for each private import from Lightning and each
    private Lightning name, in order, ``own`` being the package's own names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_lightning_module(node.module or ""):
            private = [part for part in node.module.split(".") if is_private(part)]
            private += [alias.name for alias in node.names if is_private(alias.name)]
            if private:
                found.append((node.lineno, ", ".join(private), f"imports {', '.join(private)} from {node.module}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_lightning_module(alias.name) and any(is_private(part) for part in alias.name.split(".")):
                    found.append((node.lineno, alias.name, f"imports {alias.name}"))
        elif isinstance(node, ast.Attribute) and _lightnings(node.attr, own):
            found.append(
                (node.lineno, node.attr, f"{textwrap.shorten(ast.unparse(node), 100)}: Lightning's {node.attr}")
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _lightnings(node.value, own):
            found.append((node.lineno, node.value, f"{node.value!r} names Lightning's {node.value}"))
    return sorted(found)


def private_api_uses() -> list[str]:
    """Every use of Lightning's private API outside the shim, as ``"path:line: what"``, in order."""
    found = {(_relative(path), line, name): what for (path, line, name), what in package_subclass_uses().items()}
    own = own_names()
    for path in _package_files():
        for line, name, what in source_uses(path.read_bytes(), own):
            found.setdefault((_relative(path), line, name), what)
    return [f"{path}:{line}: {what}" for (path, line, _), what in sorted(found.items())]


def test_only_the_shim_touches_lightnings_private_api():
    found = private_api_uses()
    listed = "\n".join(found)
    assert not found, f"Lightning's private API outside lightning/_lightning.py (add a function there):\n{listed}"


# ---------------------------------------------------------------------------------------- the rule, on samples

SAMPLE = """\
from lightning.fabric.utilities.seed import _collect_rng_states
import lightning.pytorch.trainer.connectors.logger_connector.result
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher as Launcher
def step(self, trainer, closure, module, dist):
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = None
    result = getattr(closure, "_result", None)
    results = trainer._results
    job = self._job
    children = module._modules
    store = dist.distributed_c10d._get_default_store()
"""


def test_the_scan_finds_private_imports_attributes_and_names():
    found = source_uses(SAMPLE, own_names())
    assert [line for line, _, _ in found] == [1, 3, 5, 6, 7], found
    assert "_job" in own_names() and "_modules" in lightning_names()  # the package's own; torch's (TORCH_NAMES)
    assert "_get_default_store" not in lightning_names()  # torch's alone


class _Probe(ParallelStrategy):
    def _configure_launcher(self) -> None:
        self._launcher = None

    def probe(self) -> tuple:
        return self._lightning_module, self._probe_state


def test_the_scan_finds_a_lightning_subclass_touching_its_base():
    found = subclass_uses(_Probe, ours=lambda cls: cls is _Probe)
    assert sorted(name for _, _, name in found) == ["_configure_launcher", "_launcher", "_lightning_module"], found
    assert subclass_uses(type("Plain", (), {}), ours=lambda cls: True) == {}


def test_the_shim_is_where_the_uses_are():
    """The scan, run on the shim as if it were another module, finds the uses it holds."""
    found = source_uses(SHIM.read_bytes(), own_names())
    assert len(found) >= 10 and "_broadcast_sigterm_tensor" in {name for _, name, _ in found}, found


def test_the_shim_reaches_what_it_names():
    """The shim's functions on Lightning's real objects (those a unit test can make without a run)."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
    from lightning.pytorch.trainer.states import TrainerFn
    from torch.utils.data import DataLoader, SequentialSampler

    from lightning_gpipe.lightning import _lightning as shim

    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert shim.logged_results(trainer) is None and shim.backward_skipped(trainer) is False
    assert shim.uses_distributed_sampler(trainer) is True
    assert shim.original_signal_handler(trainer, signal.SIGTERM) is None
    shim.mark_sigterm(trainer)
    assert trainer.received_sigterm
    calls: list[None] = []
    shim.replace_sigterm_broadcast(trainer, lambda: calls.append(None))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [None]
    trainer.state.fn = TrainerFn.VALIDATING
    assert shim.evaluation_max_batches(trainer) == []
    assert shim.attached_trainer(lightning.LightningModule()) is None
    assert shim.default_process_group_backend(torch.device("cpu")) == "gloo"

    summary = ModelSummary(max_depth=3, mode=True)
    assert shim.summary_max_depth(summary) == 3 and shim.summary_kwargs(summary) == {"mode": True}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert (
        shim.torch_optimizer(LightningOptimizer(optimizer)) is optimizer
        and shim.torch_optimizer(optimizer) is optimizer
    )
    closure = Closure(lambda: ClosureResult(torch.tensor(2.0), extra={"a": 1}))
    closure()
    assert shim.closure_result(closure).extra == {"a": 1} and shim.closure_result(lambda: None) is None
    plugin = Precision()
    shim.set_plugin_class(plugin, type("Sub", (Precision,), {}))
    assert type(plugin).__name__ == "Sub" and isinstance(plugin, Precision)
    loader = shim.with_sampler(DataLoader(list(range(8)), shuffle=True, batch_size=4), SequentialSampler(range(8)))
    assert [batch.tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]

    states = shim.collect_rng_states()
    drawn = torch.rand(3)
    shim.set_rng_states(states)
    assert torch.equal(torch.rand(3), drawn)

    results = _ResultCollection(training=True)
    results.batch_idx = 0
    results.log("training_step", "loss", torch.tensor(1.5), on_step=True, on_epoch=True, batch_size=4)
    (value,) = results.values()
    tensors, scalars = shim.result_metric_state(value)
    rebuilt = shim.new_result_metric(value.meta, torch.device("cpu"))
    shim.set_result_metric_state(rebuilt, tensors, scalars)
    again, again_scalars = shim.result_metric_state(rebuilt)
    assert again_scalars == scalars and again.keys() == tensors.keys() and torch.equal(again["value"], tensors["value"])
    assert shim.result_metric_state(object()) is None

    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    launcher = _SubprocessScriptLauncher(LightningEnvironment(), num_processes=2, num_nodes=1)
    launcher.procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
    (started,) = launcher.procs
    shim.end_launched_processes(launcher)
    assert launcher.procs == [] and started.returncode is not None
    shim.end_launched_processes(None)  # another launcher (or none): left to it


# ------------------------------------------------------------------------------------- the shim's docstrings


def requirement(name: str = "lightning") -> Requirement:
    """``name``'s requirement in ``pyproject.toml`` (``"lightning>=2.6.0,<2.7"``)."""
    (text,) = re.findall(rf'"({name}\s*[<>=!~][^"]*)"', (PACKAGE.parent / "pyproject.toml").read_text())
    return Requirement(text)


def shim_documentation(shim: Path = SHIM) -> dict[str, tuple[str, str]]:
    """A shim's public names and the module itself (``""``): name -> (``"module"``, ``"def"`` for a function or
    class, or ``"constant"``; its docstring, ``""`` when it has none, a constant's the string after it)."""
    tree = ast.parse(shim.read_bytes())
    found = {"": ("module", ast.get_docstring(tree) or "")}
    for node, after in zip(tree.body, tree.body[1:] + [None]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = ("def", ast.get_docstring(node) or "")
        elif isinstance(node, ast.Assign):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = ("constant", after.value.value if documented else "")
    return {name: entry for name, entry in found.items() if not is_private(name)}


def test_the_shim_says_why_and_on_which_versions_each_use_was_checked():
    pinned = requirement("lightning").specifier
    documented = shim_documentation()
    assert {"", "logged_results", "backward_skipped", "replace_sigterm_broadcast"} <= set(documented)
    unchecked = [name for name, (_, text) in documented.items() if not CHECKED.search(text)]
    assert unchecked == [], f"these need a 'Checked on: lightning X.Y.Z' line: {unchecked}"
    versions = {v for _, text in documented.values() for v in CHECKED.search(text).group(1).split(", ")}
    assert versions and all(Version(v) in pinned for v in versions), (versions, str(pinned))
    unexplained = [name for name, (kind, text) in documented.items() if kind == "def" and "Why:" not in text]
    assert unexplained == [], f"these need a 'Why:' paragraph: {unexplained}"


# ------------------------------------------------------------------------------------------------ torch: (d) to (f)

TORCH_SHIM = PACKAGE / "_torch.py"

TORCH_CHECKED = re.compile(r"Checked on: torch (\d+\.\d+\.\d+(?:, \d+\.\d+\.\d+)*)")
"""The line each of the torch shim's public names carries: the torch versions it was checked on."""

TORCH_SAVED = "_saved_"
"""The prefix of an autograd node's saved values (``node._saved_mat1``), which torch binds in C++."""

_TORCH_BINDS = re.compile(r"^\s+def (_[A-Za-z]\w*)\(self\b|\.(_[A-Za-z]\w*)\s*(?::[^=\n]*)?=(?!=)", re.MULTILINE)
"""A method of a class (``def _x(self``) or an assignment to an attribute (``obj._x = ``, ``self._x: T = ``)."""


@cache
def torch_names() -> frozenset[str]:
    """The private names the installed torch's Python source binds on objects (see the module docstring, (f)), read
    with :data:`_TORCH_BINDS` (an AST parse of its 2,000 files takes 15 times as long)."""
    root = Path(torch.__file__).parent
    found = (m.group(1) or m.group(2) for path in root.rglob("*.py") for m in _TORCH_BINDS.finditer(path.read_text()))
    return frozenset(found)


@cache
def own_attributes() -> frozenset[str]:
    """The private names the package's own classes bind on themselves or their instances: ``def``, class attributes
    and assignments to attributes of ``self`` or ``cls`` (the torch shim's aside)."""
    self_or_cls = frozenset({"self", "cls"})
    trees = [ast.parse(path.read_bytes()) for path in _package_files() if path != TORCH_SHIM]
    classes = [node for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    return frozenset(name for node in classes for name in bindings(node, self_or_cls))


def _torchs(name: str, own: frozenset[str]) -> bool:
    if not is_private(name) or name in own:
        return False
    return name.startswith(TORCH_SAVED) or (
        name in torch_names() and (name not in lightning_names() or name in TORCH_NAMES)
    )


def _is_torch_module(module: str) -> bool:
    return module.split(".")[0] == "torch"


def _torch_roots(tree: ast.AST) -> set[str]:
    """The names a module binds by importing from torch (``torch``, ``dist``, ``nn``, ``F``, ``Tensor``)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.asname or alias.name.split(".")[0] for alias in node.names if _is_torch_module(alias.name)}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch_module(node.module or ""):
            roots |= {alias.asname or alias.name for alias in node.names}
    return roots


def _chain_root(node: ast.Attribute) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def torch_uses(source: str | bytes, own: frozenset[str]) -> list[tuple[int, str, str]]:
    """Rules (d) to (f) for one module's source: (line, name, what) for each use of torch's private API, in order,
    ``own`` being the names the package's classes bind."""
    tree = ast.parse(source)
    roots, found = _torch_roots(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_torch_module(node.module or ""):
            private = [part for part in node.module.split(".") if is_private(part)]
            private += [alias.name for alias in node.names if is_private(alias.name)]
            if private:
                found.add((node.lineno, ", ".join(private), f"imports {', '.join(private)} from {node.module}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_module(alias.name) and any(is_private(part) for part in alias.name.split(".")):
                    found.add((node.lineno, alias.name, f"imports {alias.name}"))
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            if _chain_root(node) in roots or _torchs(node.attr, own):
                found.add((node.lineno, node.attr, f"{textwrap.shorten(ast.unparse(node), 100)}: torch's {node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _torchs(node.value, own):
            found.add((node.lineno, node.value, f"{node.value!r} names torch's {node.value}"))
    return sorted(found)


def private_torch_uses() -> list[str]:
    """Every use of torch's private API outside the torch shim, as ``"path:line: what"``, in order."""
    own = own_attributes()
    found = [
        f"{_relative(path)}:{line}: {what}"
        for path in _package_files()
        if path != TORCH_SHIM
        for line, _, what in torch_uses(path.read_bytes(), own)
    ]
    return found


def test_only_the_torch_shim_touches_torchs_private_api():
    found = private_torch_uses()
    listed = "\n".join(found)
    assert not found, f"torch's private API outside lightning_gpipe/_torch.py (add a function there):\n{listed}"


TORCH_SAMPLE = """\
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner as Planner
def step(self, module, node, scaler, optimizer):
    torch._functorch.config.donated_buffer = False
    store = dist.distributed_c10d._get_default_store()
    layers = module._modules
    found = scaler._per_optimizer_states[id(optimizer)]
    inputs = node._saved_mat1
    reset = getattr(module, "_reset_parameters")
    return self._job, self._results, torch.nn.Linear
"""


def test_the_torch_scan_finds_private_imports_chains_attributes_and_names():
    found = torch_uses(TORCH_SAMPLE, own_attributes())
    assert [line for line, _, _ in found] == [3, 4, 6, 7, 8, 9, 10, 11], found
    assert "_job" in own_attributes() and "_results" in lightning_names()  # the package's own; Lightning's
    assert {"_modules", "_lazy_init", "_fsdp_param_groups", "_num_samples"} <= torch_names()


def test_the_torch_shim_is_where_the_uses_are():
    """The scan, run on the torch shim as if it were another module, finds the uses it holds."""
    found = {name for _, name, _ in torch_uses(TORCH_SHIM.read_bytes(), own_attributes())}
    assert {"_modules", "_pytree", "_get_default_store", "_functorch", "_lazy_init", "_num_samples"} <= found, found


def test_the_torch_shim_says_why_and_on_which_versions_each_use_was_checked():
    pinned = requirement("torch").specifier
    assert Version("2.13.0") in pinned and Version("2.14.0") not in pinned, pinned  # capped below the next minor
    documented = shim_documentation(TORCH_SHIM)
    assert {"", "children", "tree_flatten", "remove_fully_shard"} <= set(documented)
    unchecked = [name for name, (_, text) in documented.items() if not TORCH_CHECKED.search(text)]
    assert unchecked == [], f"these need a 'Checked on: torch X.Y.Z' line: {unchecked}"
    versions = {v for _, text in documented.values() for v in TORCH_CHECKED.search(text).group(1).split(", ")}
    assert versions and all(Version(v) in pinned for v in versions), (versions, str(pinned))
    unexplained = [name for name, (kind, text) in documented.items() if kind != "module" and "Why:" not in text]
    assert unexplained == [], f"these need a 'Why:' paragraph: {unexplained}"


def test_the_torch_shim_reaches_what_it_names(tmp_path, monkeypatch):
    """The torch shim's names on torch's real objects (those a unit test can make without a process group)."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.utils.data import RandomSampler

    from lightning_gpipe import _torch as shim

    layer = nn.Linear(2, 2)
    sequential = nn.Sequential(layer, nn.ReLU(), layer)
    assert [name for name, _ in sequential.named_children()] == ["0", "1"]  # what the shim is for
    assert list(shim.children(sequential)) == ["0", "1", "2"]
    x = torch.randn(3, 2, requires_grad=True)
    node = layer(x).grad_fn
    assert node.name() == "AddmmBackward0" and shim.saved(node, "mat1") is x and shim.saved(node, "alpha") == 1
    leaves, _ = shim.tree_flatten({"a": (x, 1)})
    assert leaves[0] is x and shim.tree_leaves([x, {"b": 2}]) == [x, 2]
    assert isinstance(nn.BatchNorm2d(1), shim.BatchNormBase)
    assert [name for name in shim.RESET_METHODS if hasattr(nn.MultiheadAttention(2, 1), name)] == ["_reset_parameters"]
    assert shim.requested_samples(RandomSampler(range(4))) is None
    assert shim.requested_samples(RandomSampler(range(4), num_samples=2)) == 2
    scaler = torch.amp.GradScaler("cpu")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler.scale(layer(x).sum()).backward()
    scaler.unscale_(optimizer)
    assert shim.scaler_device(scaler) == "cpu" and list(shim.found_inf_per_device(scaler, optimizer).values()) == [0]
    monkeypatch.setattr(torch._functorch.config, "donated_buffer", True)
    shim.keep_donated_buffers_off()
    assert torch._functorch.config.donated_buffer is False
    dcp.save({"state_dict": {"w": torch.arange(3.0)}, "loops": [1]}, checkpoint_id=tmp_path, no_dist=True)
    read = shim.read_checkpoint(tmp_path)
    assert torch.equal(read["state_dict"]["w"], torch.arange(3.0)) and read["loops"] == [1]


if __name__ == "__main__":  # the uses, one a line (also over another checkout: PYTHONPATH=that/checkout)
    print("\n".join(private_api_uses() + private_torch_uses()) or "none", file=sys.stderr)
