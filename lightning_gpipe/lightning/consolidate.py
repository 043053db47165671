"""Open a sharded checkpoint without the strategy: turn its directory into the single-file (``"full"``) checkpoint.

``GPipeStrategy(state_dict_type="sharded")`` writes a checkpoint as a directory (see
:mod:`lightning_gpipe.lightning.state_dict`): torch.distributed.checkpoint files holding every stage's weights and
optimizer state, plus ``meta.pt`` with the rest of Lightning's checkpoint (loops, callbacks, schedulers,
hyperparameters). Lightning's own loaders read files, so ``MyModule.load_from_checkpoint(directory)`` fails with
``IsADirectoryError``. This module reads the directory in one plain process (no process group, no strategy) and
writes the dictionary a ``state_dict_type="full"`` run writes at the same step: ``state_dict`` under the original
parameter names, ``optimizer_states`` keyed by parameter name, every other entry of ``meta.pt`` unchanged. The
file loads with ``MyModule.load_from_checkpoint(path)`` and resumes under ``GPipeStrategy`` with any number of
stages.

From a shell::

    python -m lightning_gpipe.consolidate checkpoints/epoch=0-step=3.ckpt model.ckpt

From Python: :func:`consolidate` (write the file), :func:`consolidated_checkpoint` (the dictionary, in memory)
and :func:`load_from_checkpoint` (a module from a checkpoint file or a sharded directory).

The whole checkpoint is held in the memory of this one process, as with a ``"full"`` checkpoint on global rank 0.
Reading a checkpoint unpickles its non-tensor entries (as torch.distributed.checkpoint and ``torch.load`` with
``weights_only=False`` do): open only checkpoints you trust.
"""

import argparse
import os
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from lightning_gpipe._torch import read_checkpoint
from lightning_gpipe.lightning.state_dict import DCP_METADATA, METADATA, DamagedCheckpointError, read_metadata, reading

COMMAND = "python -m lightning_gpipe.consolidate"
"""The shell command that writes a sharded checkpoint directory as one file (see :func:`main`)."""

_Loadable = TypeVar("_Loadable")


def consolidated_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """The single-file Lightning checkpoint of a sharded checkpoint directory, in memory, with its tensors on the CPU.

    Args:
        directory: a directory written by ``GPipeStrategy(state_dict_type="sharded")``.

    Returns:
        the dictionary a ``state_dict_type="full"`` run writes: ``"state_dict"`` (every stage's weights under their
        original names), ``"optimizer_states"`` (one dictionary per optimizer, keyed by parameter name in
        torch.distributed.checkpoint's flattened form, e.g. ``state.backbone.3.weight.exp_avg``; absent if the
        checkpoint was saved with weights only) and every entry of ``meta.pt`` (``epoch``, ``global_step``,
        ``loops``, ``callbacks``, ``lr_schedulers``, ``hyper_parameters``, ...).

    Raises:
        FileNotFoundError: if ``directory`` does not exist, has no ``meta.pt`` (not a sharded checkpoint), or has
            ``meta.pt`` but no torch.distributed.checkpoint metadata or not every shard file (an incomplete copy).
        NotADirectoryError: if ``directory`` is a file (a single-file checkpoint already).
        DamagedCheckpointError: if a file of the directory is damaged or truncated, naming it.
    """
    directory = _checkpoint_directory(directory)
    if not (directory / DCP_METADATA).is_file():
        raise FileNotFoundError(
            f"{directory} has {METADATA} but no torch.distributed.checkpoint metadata ({directory / DCP_METADATA}):"
            " the stages' part of the checkpoint is missing. Copy the whole directory."
        )
    read_metadata(directory)  # names a damaged or truncated file before the read stops in it
    # the nested dictionary ("state_dict", "optimizer_states": [...]) rebuilt from the saved metadata, so the stages'
    # entries need no template
    stages = read_checkpoint(directory)
    with reading(directory / METADATA):
        meta = torch.load(directory / METADATA, map_location="cpu", weights_only=False)
    return {**meta, **stages}


def consolidate(directory: str | os.PathLike, output: str | os.PathLike, *, force: bool = False) -> Path:
    """Write the sharded checkpoint ``directory`` as one checkpoint file at ``output``.

    The file holds :func:`consolidated_checkpoint` of ``directory``. It is written under a temporary name next to
    ``output`` and renamed once complete, so an interrupted run leaves no partial ``output``. Missing parent
    directories of ``output`` are created.

    Args:
        directory: a directory written by ``GPipeStrategy(state_dict_type="sharded")``.
        output: the checkpoint file to write (e.g. ``model.ckpt``).
        force: replace an existing ``output`` file. Without it an existing ``output`` is never touched.

    Returns:
        ``output``, as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: if ``directory`` is not a sharded checkpoint (see :func:`consolidated_checkpoint`).
        NotADirectoryError: if ``directory`` is a file (a single-file checkpoint already).
        FileExistsError: if ``output`` exists and ``force`` is false.
        IsADirectoryError: if ``output`` is a directory (never replaced, even with ``force``).
    """
    output = Path(output)
    _consolidate(Path(directory), output, force)
    return output


def load_from_checkpoint(module_class: type[_Loadable], checkpoint_path: str | os.PathLike, **kwargs: Any) -> _Loadable:
    """``module_class.load_from_checkpoint(checkpoint_path, **kwargs)`` that also reads a sharded checkpoint directory.

    Lightning's ``load_from_checkpoint`` reads files only (a directory raises ``IsADirectoryError``). A sharded
    directory is written as one file in a temporary directory first (:func:`consolidate`, under ``TMPDIR``; it
    takes the size of the checkpoint on disk until this returns), then loaded from there by Lightning, so the
    result is exactly what ``load_from_checkpoint`` of the consolidated file gives. Anything else is passed to
    Lightning unchanged.

    Args:
        module_class: a ``LightningModule`` (or ``LightningDataModule``) subclass.
        checkpoint_path: a checkpoint file, or a directory written by ``GPipeStrategy(state_dict_type="sharded")``.
        **kwargs: passed on to ``module_class.load_from_checkpoint`` (``map_location``, ``strict``,
            ``weights_only``, hyperparameters to override, ...).

    Returns:
        the module with the checkpoint's weights (no optimizer state: a module has none).

    Raises:
        FileNotFoundError: if ``checkpoint_path`` is a directory but not a sharded checkpoint (see
            :func:`consolidated_checkpoint`), or does not exist.
    """
    if not Path(checkpoint_path).is_dir():
        return module_class.load_from_checkpoint(checkpoint_path, **kwargs)  # type: ignore[attr-defined]
    with tempfile.TemporaryDirectory(prefix="lightning_gpipe_") as scratch:
        path = consolidate(checkpoint_path, Path(scratch) / "consolidated.ckpt")
        return module_class.load_from_checkpoint(path, **kwargs)  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    """The command ``python -m lightning_gpipe.consolidate DIRECTORY OUTPUT [--force]`` (see :func:`consolidate`).

    Args:
        argv: the command's arguments (``None``: ``sys.argv[1:]``).

    Returns:
        0 once ``OUTPUT`` is written; a line on stdout names it and what it holds.

    Raises:
        SystemExit: with status 2 and a message on stderr for a ``DIRECTORY`` that is not a sharded checkpoint (or
            a damaged one) or an ``OUTPUT`` that exists (without ``--force``) or is a directory; with status 0 after
            ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description=(
            "Write a sharded checkpoint directory of GPipeStrategy(state_dict_type='sharded') as one Lightning"
            " checkpoint file: the file a state_dict_type='full' run writes (weights under their original names,"
            " optimizer state keyed by parameter name, epoch, loops, callbacks, schedulers, hyperparameters). It"
            " loads with MyModule.load_from_checkpoint(OUTPUT) without the strategy and resumes under GPipeStrategy"
            " with any number of stages. Runs in one plain process; the whole checkpoint must fit in its memory."
        ),
        epilog=f"example: {COMMAND} checkpoints/epoch=0-step=3.ckpt model.ckpt",
    )
    parser.add_argument(
        "directory", type=Path, metavar="DIRECTORY", help="the sharded checkpoint directory (it holds meta.pt)"
    )
    parser.add_argument("output", type=Path, metavar="OUTPUT", help="the checkpoint file to write, e.g. model.ckpt")
    parser.add_argument(
        "--force", action="store_true", help="replace OUTPUT if it exists (by default an existing file is kept)"
    )
    args = parser.parse_args(argv)
    try:
        checkpoint = _consolidate(args.directory, args.output, args.force)
    except (FileNotFoundError, NotADirectoryError, FileExistsError, IsADirectoryError, DamagedCheckpointError) as error:
        parser.error(str(error))
    print(f"Wrote {args.output}: {_summary(checkpoint)}.")
    return 0


def _consolidate(directory: Path, output: Path, force: bool) -> dict[str, Any]:
    """:func:`consolidate`, returning the checkpoint written."""
    _check_output(output, force)  # before the long read
    checkpoint = consolidated_checkpoint(directory)
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    try:
        with open(staging, "xb") as file:  # the permissions torch.save(checkpoint, output) would give
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        _publish(staging, output, force)
    finally:
        staging.unlink(missing_ok=True)
    return checkpoint


def _checkpoint_directory(directory: str | os.PathLike) -> Path:
    """``directory`` as a Path, checked to be a sharded checkpoint directory."""
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist.")
    if not directory.is_dir():
        raise NotADirectoryError(
            f"{directory} is a file, not a sharded checkpoint directory: it is a single-file checkpoint already"
            " (load it with MyModule.load_from_checkpoint)."
        )
    if not (directory / METADATA).is_file():
        raise FileNotFoundError(
            f"{directory} is not a sharded GPipe checkpoint: expected a directory written by"
            f" GPipeStrategy(state_dict_type='sharded'), holding {METADATA} (the trainer state) next to the"
            f" torch.distributed.checkpoint files (.metadata, *.distcp); {METADATA} is missing."
        )
    return directory


def _check_output(output: Path, force: bool) -> None:
    if output.is_dir():
        raise IsADirectoryError(f"{output} is a directory; give the path of the checkpoint file to write.")
    if output.exists() and not force:
        raise FileExistsError(
            f"{output} exists; choose another path, or replace it with --force (in Python: force=True)."
        )


def _publish(staging: Path, output: Path, force: bool) -> None:
    """Give the complete file ``staging`` the name ``output``: atomically, and without replacing a file that appeared
    at ``output`` meanwhile unless ``force``."""
    if force:
        _check_output(output, force)
        os.replace(staging, output)
        return
    try:
        os.link(staging, output)  # fails if `output` exists, where a check followed by a rename could race
    except FileExistsError:
        raise FileExistsError(f"{output} was created while the checkpoint was being written; it was kept.") from None
    except OSError:  # a file system without hard links
        _check_output(output, force)
        os.replace(staging, output)


def _summary(checkpoint: dict[str, Any]) -> str:
    """What a checkpoint holds, in a few words."""
    tensors = [value for value in checkpoint.get("state_dict", {}).values() if isinstance(value, torch.Tensor)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    size_text = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.1f} KiB"
    optimizers = len(checkpoint.get("optimizer_states", []))
    return (
        f"{len(tensors)} weight tensors ({size_text}), {optimizers} optimizer state{'s' * (optimizers != 1)},"
        f" epoch {checkpoint.get('epoch')}, global step {checkpoint.get('global_step')}"
    )
