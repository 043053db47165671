"""A stage's own weights from a checkpoint directory's safetensors files, and a pipelined ``save_pretrained``.

:class:`SafetensorsWeights` reads named tensors from the ``*.safetensors`` files of a local Hugging Face checkpoint
directory (``model.safetensors``, or the shards listed in ``model.safetensors.index.json``) with
``safetensors.safe_open``, which reads only the requested tensors from disk: a stage reading its layers' names
never holds another stage's weights. :func:`save_stage_shards` is the other way: every stage writes its own
parameters as one shard of a Hugging Face checkpoint, and global rank 0 writes the index and the config, so the
directory loads with ``from_pretrained`` without any process holding the whole model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

try:
    from safetensors import safe_open
    from safetensors.torch import save_file
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError("lightning_gpipe.hf needs `safetensors` (installed with transformers)") from error

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsWeights:
    """The tensors of a local checkpoint directory, read by name.

    Args:
        directory: a directory written by ``save_pretrained`` (``model.safetensors`` or an index and its shards).
        tied: the model's tied names, ``{name: name it is tied to}`` (``model.all_tied_weights_keys``): a name the
            files lack is read under the name it is tied to, as ``save_pretrained`` writes a tied tensor once.
        prefix: the model's ``base_model_prefix`` (``"model"``): a name the files lack is also tried without it,
            and with it, so a base model's checkpoint loads into a model with a head and the other way round.

    Raises:
        FileNotFoundError: if the directory holds no safetensors file.
    """

    def __init__(
        self, directory: str | os.PathLike, tied: Optional[Mapping[str, str]] = None, prefix: str = ""
    ) -> None:
        self.directory = Path(directory)
        self.tied, self.prefix = dict(tied or {}), prefix
        index = self.directory / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.directory} holds no *.safetensors file (nor {INDEX}): give a directory written by"
                    " `save_pretrained` (safe_serialization, the default), or load the model with from_pretrained."
                )
            self.file_of = {}
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    self.file_of.update((name, file) for name in f.keys())

    def _stored_name(self, name: str) -> Optional[str]:
        candidates = [name, self.tied.get(name)]
        if self.prefix:
            candidates += [name[len(self.prefix) + 1 :] if name.startswith(self.prefix + ".") else None]
            candidates += [f"{self.prefix}.{name}"]
        return next((c for c in candidates if c is not None and c in self.file_of), None)

    def load(self, names: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Read the tensors of ``names`` (and nothing else) onto ``device``.

        Raises:
            KeyError: naming the names the checkpoint lacks.
        """
        names = list(names)
        stored = {name: self._stored_name(name) for name in names}
        missing = [name for name, found in stored.items() if found is None]
        if missing:
            raise KeyError(
                f"{self.directory} lacks {len(missing)} tensors of this stage: {', '.join(missing[:5])}. Is it a"
                " checkpoint of the same architecture and configuration?"
            )
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[stored[name]], []).append(name)
        result: dict[str, Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt", device=str(torch.device(device))) as f:
                for name in wanted:
                    result[name] = f.get_tensor(stored[name])
        return result


def save_stage_shards(
    directory: str | os.PathLike,
    state: Mapping[str, Tensor],
    stage: int,
    num_stages: int,
    config: Any,
    skip: Iterable[str] = (),
    gather: Any = None,
    write_index: bool = True,
) -> Path:
    """Write one stage's tensors as shard ``stage + 1`` of ``num_stages`` of a Hugging Face checkpoint.

    Every stage calls it with its own state (names as the model's); ``gather(obj)`` must return the list of every
    stage's ``obj`` (an all-gather), after which the process with ``write_index=True`` writes
    ``model.safetensors.index.json`` and ``config.json``. With one stage, it writes ``model.safetensors`` and the
    config (``gather`` unused).

    Args:
        directory: where to write (created).
        state: this stage's tensors, by the model's names.
        stage: this stage's index.
        num_stages: the number of stages.
        config: the model's ``PretrainedConfig`` (``save_pretrained`` is called on it).
        skip: names not to write (tied names ``save_pretrained`` leaves out).
        gather: all-gather of a picklable object over the stages (needed when ``num_stages > 1``).
        write_index: whether this process writes the index and config.

    Returns:
        The directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    skip = set(skip)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items() if name not in skip}
    file = SINGLE if num_stages == 1 else f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"
    save_file(_unshared(tensors), str(directory / file), metadata={"format": "pt"})
    if num_stages == 1:
        if write_index:
            config.save_pretrained(directory)
        return directory
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    everything = gather((file, sizes))
    if write_index:
        weight_map, total = {}, 0
        for shard, shard_sizes in everything:
            for name, size in shard_sizes.items():
                weight_map.setdefault(name, shard)
                total += size
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config.save_pretrained(directory)
    return directory


def _unshared(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors sharing memory: clone the second and later names of one storage."""
    seen: set[tuple[int, int]] = set()
    result = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result
