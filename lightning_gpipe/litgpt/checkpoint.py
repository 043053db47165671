"""litgpt's checkpoints read by stages: :class:`LitCheckpoint` gives each backbone layer its own tensors of a
``lit_model.pth`` (litgpt's save format: ``torch.save`` of the ``GPT``'s state dict, or of ``{"model": state dict}``
as its fine-tuning scripts write), memory-mapped, so a stage reads from the file only its layers' tensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

CHECKPOINT_FILE = "lit_model.pth"
"""The file a litgpt checkpoint directory holds the weights in."""


def checkpoint_file(path: str | os.PathLike) -> Path:
    """The weights file of ``path``: ``path`` itself, or a directory's :data:`CHECKPOINT_FILE`.

    Raises:
        FileNotFoundError: if there is none (naming the path).
    """
    path = Path(path)
    file = path / CHECKPOINT_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"No litgpt checkpoint at {file} (a `lit_model.pth`, or a directory holding one).")
    return file


class LitCheckpoint:
    """A ``lit_model.pth`` as the :attr:`~lightning_gpipe.litgpt.layer.LitLayer.weights` of backbone layers.

    The file is opened at the first :meth:`load`, with ``torch.load(mmap=True, weights_only=True)``: its tensors stay
    on disk, and each layer copies out only those of its own names, so a stage reads its own part of the file.

    Args:
        path: a ``lit_model.pth`` file or a litgpt checkpoint directory holding one.

    Raises:
        FileNotFoundError: if there is no such file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = checkpoint_file(path)
        self._state: dict[str, Tensor] | None = None

    def __repr__(self) -> str:
        return str(self.path)

    def state(self) -> dict[str, Tensor]:
        """The file's state dict, memory-mapped (opened once)."""
        if self._state is None:
            loaded: Any = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            self._state = loaded.get("model", loaded)
        return self._state

    def load(self, names: list[str], device: torch.device) -> dict[str, Tensor]:
        """The tensors of ``names`` on ``device``, read from the file.

        Raises:
            KeyError: if the file lacks some of them (naming them and the file).
        """
        state = self.state()
        missing = [name for name in names if name not in state]
        if missing:
            raise KeyError(
                f"{self.path} has no {missing[:3]}{' ...' if len(missing) > 3 else ''}: is it a checkpoint of this"
                " model's config?"
            )
        return {name: state[name].to(device) for name in names}
