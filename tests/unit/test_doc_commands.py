"""The docs against the code: `GPipeStrategy` arguments exist and take the values the docs give them, the modules,
names and files the docs name exist, every public name is on an API page, data errors are clear (the runnable command
blocks, which start stage processes, run in tests/distributed/test_doc_commands.py).

**Strategy arguments.** :func:`test_gpipe_strategy_arguments_named_in_the_docs_exist` reads README.md, docs/*.md and
the example READMEs for ``GPipeStrategy(name=value, ...)`` calls and ``--trainer.strategy.name=`` options (the
names must be parameters of ``GPipeStrategy``), for a call followed by a ``# default`` comment, and for prose such as
"the default `checkpoint="except_last"`" or "`chunks=None` (default)" about a ``GPipeStrategy`` parameter (the
value must then be its default). Anything that does not parse as Python is left alone.

**Data errors.** :func:`test_example_commands_fail_fast_with_the_prepare_command_when_data_is_missing` runs each
example's README commands from an empty directory with the data option pointing at a missing directory, and with
the Hub dataset under ``HF_HUB_OFFLINE=1`` and an empty Hugging Face cache: the command must stop, before any
second stage process starts, with the option and the ``prepare.py`` command in its message.
"""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from conftest import concurrently

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.lightning.config import CHOICES

ROOT = Path(__file__).resolve().parents[2]


STRATEGY_DOCS = ("README.md", "docs/*.md", "examples/*/README.md")
"""Where :func:`test_gpipe_strategy_arguments_named_in_the_docs_exist` looks."""

PARAMETERS = inspect.signature(GPipeStrategy).parameters


def _calls(text: str) -> list[tuple[int, str, str]]:
    """``(line, call, rest of its line)`` of each ``GPipeStrategy(...)`` in ``text``, parentheses balanced."""
    found = []
    for match in re.finditer(r"GPipeStrategy\(", text):
        depth, end = 0, None
        for position in range(match.end() - 1, len(text)):
            depth += {"(": 1, ")": -1}.get(text[position], 0)
            if depth == 0:
                end = position + 1
                break
        if end is not None:
            rest = text[end : text.find("\n", end) if "\n" in text[end:] else len(text)]
            found.append((text.count("\n", 0, match.start()) + 1, text[match.start() : end], rest))
    return found


def _literal(source: str) -> tuple[bool, object]:
    """``(True, value)`` when ``source`` is a Python literal, else ``(False, None)``."""
    try:
        return True, ast.literal_eval(source.strip())
    except (ValueError, SyntaxError):
        return False, None


PROSE_DEFAULTS = (
    r"\b[Dd]efault:? `(\w+)=([^`]+)`",
    r"`(\w+)=([^`]+)` ?\((?:the )?default\b",
    r"`(\w+)=([^`]+)` by default",
)
"""Prose that gives a parameter's default: "the default `x=1`", "`x=1` (default)", "`x=1` by default"."""


def strategy_claims(text: str) -> list[tuple[int, str, bool, object]]:
    """``(line, parameter, whether a default is claimed, the claimed default)`` found in ``text``.

    Calls and ``--trainer.strategy.name=`` options claim that the parameter exists; a call followed by a
    ``# default`` comment and the prose of :data:`PROSE_DEFAULTS` (for names that are ``GPipeStrategy`` parameters
    only, since prose names other classes' arguments too) claim a default.
    """
    claims = []
    for line, call, rest in _calls(text):
        try:
            node = ast.parse(re.sub(r"(,\s*)?\.\.\.", "", call), mode="eval").body
        except SyntaxError:
            continue
        is_default = rest.strip().lower().startswith("# default")
        for keyword in node.keywords:
            if keyword.arg is None:
                continue
            known, value = _literal(ast.unparse(keyword.value)) if is_default else (False, None)
            claims.append((line, keyword.arg, known, value))
    for match in re.finditer(r"--trainer\.strategy\.(\w+)=", text):
        claims.append((text.count("\n", 0, match.start()) + 1, match.group(1), False, None))
    for pattern in PROSE_DEFAULTS:
        for match in re.finditer(pattern, text):
            name, (known, value) = match.group(1), _literal(match.group(2))
            if name in PARAMETERS and known:
                claims.append((text.count("\n", 0, match.start(1)) + 1, name, True, value))
    return claims


def test_strategy_claims_are_parsed_conservatively() -> None:
    """Calls, options, default comments and prose are found; other classes' arguments in prose are left alone."""
    text = (
        'GPipeStrategy(chunks=8, balance=[5, 3], ...)\n'
        'x = GPipeStrategy(\n    checkpoint="never",  # less memory\n)\n'
        'GPipeStrategy(state_dict_type="full")  # default: one file\n'
        '--trainer.strategy.chunks=4 and the default `checkpoint="except_last"`; `steps=(2,)` by default\n'
        '`chunks=None` (default) and GPipeStrategy(broken=\n'
    )  # fmt: skip
    assert strategy_claims(text) == [
        (1, "chunks", False, None), (1, "balance", False, None), (2, "checkpoint", False, None),
        (5, "state_dict_type", True, "full"), (6, "chunks", False, None), (6, "checkpoint", True, "except_last"),
        (7, "chunks", True, None),
    ]  # fmt: skip


def test_gpipe_strategy_arguments_named_in_the_docs_exist() -> None:
    """Every ``GPipeStrategy`` argument named in the docs is a parameter, with the default the docs give."""
    problems, checked = [], 0
    for path in sorted({p for pattern in STRATEGY_DOCS for p in ROOT.glob(pattern)}):
        for line, name, is_default, value in strategy_claims(path.read_text(encoding="utf-8")):
            checked += 1
            where = f"{path.relative_to(ROOT)}:{line}"
            if name not in PARAMETERS:
                problems.append(f"{where}: GPipeStrategy has no parameter {name!r}")
            elif is_default and PARAMETERS[name].default != value:
                problems.append(
                    f"{where}: the docs give {name}={value!r} as the default, GPipeStrategy's is "
                    f"{PARAMETERS[name].default!r}"
                )
    assert not problems, "\n".join(problems)
    assert checked > 10  # the docs name the strategy's arguments in many places: the parser still finds them


FAIL_FAST = [
    ("amoebanet", ["fit", "--data.data_dir=cifar10"], {}, "--data.data_dir=cifar10"),
    (
        "amoebanet",
        ["fit", "--config", "{root}/examples/amoebanet/configs/cifar10_20min.yaml"],
        {"HF_HUB_OFFLINE": "1"},
        "--data.dataset_name=uoft-cs/cifar10",
    ),
    ("translation", ["fit", "--data.data_dir=multi30k"], {}, "--data.data_dir=multi30k"),
    (
        "translation",
        ["fit", "--config", "{root}/examples/translation/configs/multi30k_30min.yaml"],
        {"HF_HUB_OFFLINE": "1"},
        "--data.dataset_name=bentrevett/multi30k",
    ),
]
"""``(example, arguments, environment, the option the message must name)``: a missing directory, and the recipe's
Hub dataset offline."""


def _fail_fast_run(example: str, args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """``examples/<example>/train.py ARGS`` with ``env`` from the empty directory ``tmp_path/fresh``, with an empty
    Hugging Face cache ``tmp_path/hf_home``."""
    cwd = tmp_path / "fresh"
    cwd.mkdir()
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), **env}
    command = [sys.executable, str(ROOT / "examples" / example / "train.py")]
    command += [arg.format(root=ROOT) for arg in args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=300)  # a hang


@pytest.fixture(scope="module")
def fail_fast_runs(tmp_path_factory) -> dict:
    """``{option: (result function, its directory)}``: each command of :data:`FAIL_FAST`, in a directory of its own,
    two at a time (:func:`conftest.concurrently`: each is a process that imports Lightning)."""
    directories = {option: tmp_path_factory.mktemp("fail_fast") for *_, option in FAIL_FAST}
    jobs = {option: partial(_fail_fast_run, e, a, env, directories[option]) for e, a, env, option in FAIL_FAST}
    results = concurrently(jobs)
    return {option: (results[option], directories[option]) for option in directories}


@pytest.mark.parametrize(("example", "args", "env", "option"), FAIL_FAST)
def test_example_commands_fail_fast_with_the_prepare_command_when_data_is_missing(
    example: str, args: list[str], env: dict, option: str, fail_fast_runs: dict
) -> None:
    """From an empty directory (no ``../shared``, an empty Hugging Face cache), a missing directory or an offline
    Hub stops the command in the first process, with the option and the prepare command, and writes nothing."""
    result_of, tmp_path = fail_fast_runs[option]
    result, cwd = result_of(), tmp_path / "fresh"
    assert result.returncode == 1, result.stderr[-3000:]
    message = result.stderr.split("error: ", 1)[-1]
    assert result.stderr.count("error: ") == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert option in message and f"python examples/{example}/prepare.py DIR" in message, message
    if "HF_HUB_OFFLINE" in env:
        assert "HF_HUB_OFFLINE is set" in message
    assert "Initializing distributed" not in result.stderr  # failed before the Trainer started the stages
    assert list(cwd.iterdir()) == []


DOCS = ("README.md", "docs/*.md", "docs/api/*.md", "examples/*/README.md", "tests/README.md")
"""Where the docs' names, paths and values are read."""


def _docs() -> list[tuple[Path, str]]:
    return [(path, path.read_text(encoding="utf-8")) for path in sorted({p for d in DOCS for p in ROOT.glob(d)})]


def _line(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _without_bad_inputs(text: str) -> str:
    """``text`` without its "Bad inputs" section (docs/contract.md's table of refused values), lines kept."""
    start = text.find("\n## Bad inputs")
    if start < 0:
        return text
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    return text[:start] + "\n" * text.count("\n", start, end) + text[end:]


def documented_values(text: str) -> list[tuple[int, str, str]]:
    """``(line, option, value)`` of every value the docs give an option that takes one of a few names
    (``CHOICES``, ``balance``'s modes, ``plan``): ``option="value"``, ``option='value'`` and
    ``--trainer.strategy.option=value``, outside the "Bad inputs" section."""
    options = "|".join(("balance", "plan", *CHOICES))
    text = _without_bad_inputs(text)
    patterns = (rf"\b({options})=[\"']([\w-]+)[\"']", rf"--trainer\.strategy\.({options})=([\w-]+)")
    found = [(_line(text, m.start()), m.group(1), m.group(2)) for p in patterns for m in re.finditer(p, text)]
    return [(line, option, value) for line, option, value in found if not value.isdigit()]


def test_documented_values_are_parsed() -> None:
    text = "x `schedule=\"zb-v\"` and --trainer.strategy.checkpoint=never\n`balance=[3, 5]` `plan='auto'`\n"
    assert documented_values(text) == [(1, "schedule", "zb-v"), (2, "plan", "auto"), (1, "checkpoint", "never")]


def test_every_value_the_docs_give_an_option_is_accepted() -> None:
    """Every ``schedule=``, ``checkpoint=``, ``balance=``... value of the docs is one ``GPipeStrategy`` takes."""
    problems, checked = [], 0
    for path, text in _docs():
        for line, option, value in documented_values(text):
            checked += 1
            try:
                GPipeStrategy(**{option: value})
            except ValueError as error:
                problems.append(f"{path.relative_to(ROOT)}:{line}: {option}={value!r}: {error}")
    assert not problems, "\n".join(problems)
    assert checked > 50


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def test_every_dotted_name_and_file_the_docs_name_exists() -> None:
    """``lightning_gpipe.x.y`` names import or resolve, and every ``path/to/file.py`` (or bare ``file.py``) the docs
    name is a file of the repository: a module that moved or was renamed leaves no stale name behind."""
    files = [path.relative_to(ROOT).as_posix() for path in ROOT.glob("**/*.py") if "site" not in path.parts[:1]]
    problems = []
    for path, text in _docs():
        for match in re.finditer(r"\blightning_gpipe(?:\.\w+)+", text):
            if not _resolves(match.group(0)):
                problems.append(f"{path.relative_to(ROOT)}:{_line(text, match.start())}: {match.group(0)}")
        for match in re.finditer(r"[\w/.]*\w\.py\b", text):
            named = match.group(0).lstrip("./")
            if not any(f == named or f.endswith("/" + named) for f in files):
                if not (path.parent / match.group(0)).exists():
                    problems.append(f"{path.relative_to(ROOT)}:{_line(text, match.start())}: {match.group(0)}")
    assert not problems, "\n".join(problems)


def _api_documented() -> set[str]:
    """The names the API pages render: ``::: dotted.name`` directives (a module's public names, or those of its
    ``members:`` list)."""
    names: set[str] = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^::: ([\w.]+)\n((?:    .*\n)*)", text, re.MULTILINE):
            dotted, options = match.groups()
            members = re.findall(r"^        - (\w+)$", options, re.MULTILINE)
            target = importlib.import_module(dotted) if _is_module(dotted) else None
            if members:
                names |= set(members)
            elif target is not None:
                names |= set(getattr(target, "__all__", [n for n in vars(target) if not n.startswith("_")]))
            else:
                names.add(dotted.rsplit(".", 1)[-1])
    return names


def _is_module(dotted: str) -> bool:
    try:
        importlib.import_module(dotted)
    except ImportError:
        return False
    return True


def test_every_public_name_is_on_an_api_page() -> None:
    import lightning_gpipe
    import lightning_gpipe.hf

    missing = {name for m in (lightning_gpipe, lightning_gpipe.hf) for name in m.__all__} - _api_documented()
    assert not missing, f"not on any page of docs/api/: {sorted(missing)}"
