"""A stage's own weights from a checkpoint directory's safetensors files, and a pipelined ``save_pretrained``.

:class:`SafetensorsWeights` reads named tensors from the ``*.safetensors`` files of a local Hugging Face checkpoint
directory (``model.safetensors``, or the shards listed in ``model.safetensors.index.json``) with
``safetensors.safe_open``, which reads only the requested tensors from disk: a stage reading its layers' names
never holds another stage's weights. :func:`save_stage_shards` is the other way: every stage writes its own
parameters as one shard of a Hugging Face checkpoint, and global rank 0 writes the index and the config, so the
directory loads with ``from_pretrained`` without any process holding the whole model.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

try:
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
        revert_weight_conversion,
    )
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "lightning_gpipe.hf needs `transformers` 5.24 or newer: pip install 'transformers>=5.24'"
    ) from error

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
        model: the model (on the meta device will do) whose checkpoints ``transformers`` converts when it loads
            them (``get_model_conversion_mapping``: e.g. a mixture of experts saved with one tensor per expert, held
            as one tensor for all): a name of the model is then read from the checkpoint tensors it is made of and
            converted as ``from_pretrained`` converts them. ``None`` (default): names are read as they are.

    Raises:
        FileNotFoundError: if the directory holds no safetensors file.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        tied: Mapping[str, str] | None = None,
        prefix: str = "",
        model: Any = None,
    ) -> None:
        self.directory = Path(directory)
        self.tied, self.prefix, self.model = dict(tied or {}), prefix, model
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
        self.converted = {} if model is None else _converted_names(model, self.file_of)

    def _stored_name(self, name: str) -> str | None:
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
        result = {name: self._convert(name, device) for name in names if name in self.converted}
        names = [name for name in names if name not in result]
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
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt", device=str(torch.device(device))) as f:
                for name in wanted:
                    result[name] = f.get_tensor(stored[name])
        return result

    def _convert(self, name: str, device: torch.device | str) -> Tensor:
        """The model's tensor ``name`` from the checkpoint tensors it is made of, converted as ``transformers``'
        ``from_pretrained`` converts them (see ``model``)."""
        sources, transform = self.converted[name]
        transform = copy.deepcopy(transform)
        for key, pattern in sources:
            with safe_open(str(self.file_of[key]), framework="pt", device=str(torch.device(device))) as f:
                transform.add_tensor(name, key, pattern, f.get_tensor(key))
        value = transform.convert(name, model=self.model, config=self.model.config)[name]
        return value[0] if isinstance(value, list) else value


def _converted_names(model: Any, keys: Iterable[str]) -> dict[str, tuple[list[tuple[str, str]], Any]]:
    """``{model name: ([(checkpoint key, source pattern), ...], transform)}`` for the model's names that
    ``transformers`` makes from checkpoint tensors of other names (its conversion mapping for ``model``, applied to
    ``keys`` as ``from_pretrained`` applies it; sources in its order). A converter with several targets (a fused
    tensor split) lists each target."""
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    names = model.state_dict()
    converted: dict[str, tuple[list[tuple[str, str]], Any]] = {}
    for key in sorted(keys, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, names)
        if name not in names or (pattern is None and name == key):
            continue
        if pattern is None:
            converted[name] = ([(key, key)], WeightRenaming(key, name))
            continue
        converter = by_pattern[pattern]
        for target in converter.target_patterns:
            sources, _ = converted.setdefault(name.replace(converter.target_patterns[0], target), ([], converter))
            sources.append((key, pattern))
    return converted


def save_stage_shards(
    directory: str | os.PathLike,
    state: Mapping[str, Tensor],
    stage: int,
    num_stages: int,
    config: Any,
    skip: Iterable[str] = (),
    gather: Any = None,
    write_index: bool = True,
    model: Any = None,
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
        model: the model, whose conversion mapping ``save_pretrained`` reverts (``revert_weight_conversion``:
            e.g. a mixture of experts' fused expert tensors back to one per expert), or ``None`` to write the names
            as they are.

    Returns:
        The directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    skip = set(skip)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items() if name not in skip}
    if model is not None:
        tensors = {name: t.contiguous() for name, t in revert_weight_conversion(model, tensors).items()}
    file = SINGLE if num_stages == 1 else f"model-{stage + 1:05d}-of-{num_stages:05d}.safetensors"
    save_file(_unshared(tensors), str(directory / file), metadata={"format": "pt"})
    if num_stages == 1:
        if write_index:
            config.save_pretrained(directory)
        return directory
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    everything = gather((file, sizes))
    if write_index:
        weight_map: dict[str, str]
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
    seen: set[tuple[int, int | torch.SymInt]] = set()
    result = {}
    for name, tensor in tensors.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        result[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return result
