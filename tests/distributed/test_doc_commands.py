"""The docs' runnable blocks run: each trains on 2 stage processes.

In README.md and docs/quickstart.md, a fenced ``python`` block right after the line ``<!-- runnable -->`` (an HTML
comment, invisible on GitHub and on the site) is a script, run as printed by :func:`test_runnable_scripts_run`; a
fenced ``bash`` block after that line is run by :func:`test_runnable_command_blocks_run`: each line of the
block (``\\`` continues a line) is split at ``&&``, the ``pip install`` parts are skipped (the package is installed),
and each ``python examples/...`` command is run from an empty directory with no ``../shared`` beside it, the script's
path made absolute, shortened by :data:`SHORTEN` (a few steps and tiny batches, appended, so they win over the
block's own values) and with ``--trainer.default_root_dir`` in a temporary directory. Mark only blocks whose
commands are cheap with these settings: every example run starts 2 stage processes. The other checks of the docs
against the code (``GPipeStrategy`` arguments, data errors) are in tests/unit/test_doc_commands.py.
"""

import shlex
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from conftest import SHORT_EXAMPLE_RUNS, beside, example_beside, run_example, scratch, started_environment

ROOT = Path(__file__).resolve().parents[2]

RUNNABLE = "<!-- runnable -->"
"""The marker line before a fenced bash block that the tests run."""

RUNNABLE_FILES = ("README.md", "docs/quickstart.md")
"""The files whose marked blocks are run."""

SHORTEN = SHORT_EXAMPLE_RUNS
"""Options appended to a runnable command of each script (a few steps, each logged, tiny batches and one validation:
those of the example's own test, tests/distributed/test_amoebanet.py and test_translation.py, which read the same run);
other scripts get ``--trainer.max_steps=2``."""


def read(name: str) -> str:
    """The text of the repository's file ``name``."""
    return (ROOT / name).read_text(encoding="utf-8")


def runnable_blocks(text: str, language: str) -> list[tuple[int, list[str]]]:
    """``(line number of the first line, lines)`` of every fenced ``language`` block marked :data:`RUNNABLE` in
    ``text``."""
    lines = text.splitlines()
    blocks = []
    for index, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        start = next(i for i in range(index + 1, len(lines)) if lines[i].strip())
        assert lines[start].startswith("```"), f"line {index + 1}: {RUNNABLE} must come right before a fenced block"
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
        if lines[start][3:].strip() == language:
            blocks.append((start + 2, lines[start + 1 : end]))
    return blocks


def runnable_commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` of every command in the fenced ``bash`` blocks marked :data:`RUNNABLE` in
    ``text``."""
    commands = []
    for first_line, block in runnable_blocks(text, "bash"):
        joined, first = "", None
        for number, line in enumerate(block, first_line):
            body = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            first = first if joined else number
            joined += body[:-1] + " " if body.endswith("\\") else body
            if not body.endswith("\\"):
                if joined.strip():
                    commands += [(first, " ".join(part.split())) for part in joined.split("&&")]
                joined = ""
    return commands


def test_runnable_marker_is_found_before_the_example_commands() -> None:
    """The parser finds the two example blocks of the README, and a marker before a non-block is an error."""
    commands = runnable_commands((ROOT / "README.md").read_text(encoding="utf-8"))
    scripts = {shlex.split(command)[1] for _, command in commands if command.startswith("python ")}
    assert scripts == {"examples/amoebanet/train.py", "examples/translation/train.py"}
    block = f"{RUNNABLE}\n\n```bash\npip install x && python a.py fit \\\n    --b=1  # note\n```\n"
    assert runnable_commands(block) == [(4, "pip install x"), (4, "python a.py fit --b=1")]
    with pytest.raises(AssertionError, match="must come right before a fenced block"):
        runnable_commands(f"{RUNNABLE}\ntext\n")


COMMANDS = [
    (name, line, command)
    for name in RUNNABLE_FILES
    for line, command in runnable_commands((ROOT / name).read_text(encoding="utf-8"))
    if not command.startswith("pip install")
]
"""``(file, line number, command)`` of every marked command but ``pip install``."""


def _shortened(command: str) -> tuple[str, list[str]]:
    """``(script, its arguments with the options that shorten the run)`` of a ``python SCRIPT ...`` command."""
    args = shlex.split(command)
    return args[1], [*args[2:], *SHORTEN.get(args[1], ["--trainer.max_steps=2"])]


def _register_commands() -> None:
    """Start each marked ``python`` command's shortened run beside the in-process tests (:func:`conftest.beside`)."""
    for _, _, command in COMMANDS:
        if command.startswith("python "):
            script, args = _shortened(command)
            example_beside(script, *args)


_register_commands()


@pytest.mark.parametrize(("name", "line", "command"), COMMANDS)
def test_runnable_command_blocks_run(name: str, line: int, command: str) -> None:
    """Each marked command runs, shortened, from an empty directory, and trains (a metrics file with losses)."""
    assert command.startswith("python "), f"{name}:{line}: only `python ...` commands are run, not {command!r}"
    script, args = _shortened(command)
    result, _, root = run_example(script, *args)
    assert result.returncode == 0, f"{name}:{line}: `{command}` failed:\n{result.stderr[-3000:]}"
    metrics = list(root.glob("lightning_logs/*/version_*/metrics.csv"))
    assert metrics and "train_loss" in metrics[0].read_text(), f"{name}:{line}: `{command}` logged no train_loss"


def test_the_quickstart_script_is_marked_runnable() -> None:
    """docs/quickstart.md's module is one marked python block (so :func:`test_runnable_scripts_run` runs it)."""
    ((_, block),) = runnable_blocks(read("docs/quickstart.md"), "python")
    script = "\n".join(block)
    assert "class Classifier(L.LightningModule):" in script and '\nif __name__ == "__main__":' in script


STRATEGIES = ("gpipe", "gpipe_spawn")
"""The strategies each marked script runs with: as printed, and the one the text offers instead."""

SCRIPTS = [(name, line, block) for name in RUNNABLE_FILES for line, block in runnable_blocks(read(name), "python")]
"""``(file, line number, lines)`` of every marked python block."""


def _run_script(block: list[str], strategy: str, directory: Path) -> subprocess.CompletedProcess:
    """``block`` as ``directory/train.py``, with ``strategy="gpipe"`` replaced by ``strategy``, run there."""
    script = "\n".join(block).replace('strategy="gpipe"', f'strategy="{strategy}"')
    (directory / "train.py").write_text(script + "\n", encoding="utf-8")
    command = [sys.executable, "train.py"]
    environment = started_environment()
    return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=400, env=environment)


def _script_runs() -> dict:
    """``{(file, line, strategy): (result function, its directory)}``: every marked script with every strategy,
    each in an empty directory of its own, started beside the in-process tests (:func:`conftest.beside`)."""
    directories = {(name, line, strategy): scratch("script_") for name, line, _ in SCRIPTS for strategy in STRATEGIES}
    blocks = {(name, line): block for name, line, block in SCRIPTS}
    return {
        key: (beside(f"script:{key}", partial(_run_script, blocks[key[:2]], key[2], d)), d)
        for key, d in directories.items()
    }


SCRIPT_RUNS = _script_runs()


@pytest.fixture(scope="module")
def script_runs() -> dict:
    """:data:`SCRIPT_RUNS`."""
    return SCRIPT_RUNS


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "line"), [pytest.param(name, line, id=f"{name}:{line}") for name, line, _ in SCRIPTS])
def test_runnable_scripts_run(name: str, line: int, strategy: str, script_runs: dict) -> None:
    """Each marked script runs as printed from an empty directory and trains to the end of its first epoch (its
    checkpoint), also with ``strategy="gpipe_spawn"``, which the text offers instead (whose workers import the
    script)."""
    result_of, directory = script_runs[name, line, strategy]
    result = result_of()
    assert result.returncode == 0, f"{name}:{line} with {strategy}:\n{result.stderr[-3000:]}"
    assert list(directory.glob("lightning_logs/version_0/checkpoints/epoch=0-step=*.ckpt")), result.stderr[-3000:]
