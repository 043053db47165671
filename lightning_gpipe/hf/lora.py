"""LoRA fine-tuning through the pipeline with ``peft`` (Hu et al. 2021, arXiv:2106.09685; ``peft``'s ``LoraConfig``).

``peft`` wraps a ``transformers`` model (``get_peft_model``): each targeted linear layer becomes a LoRA layer holding
the frozen original (``base_layer``) and the trainable adapters (``lora_A``, ``lora_B``). Those layers live inside
the model's blocks, so :func:`~lightning_gpipe.hf.to_sequential` cuts a ``peft`` model as it cuts the model inside it
(:func:`unwrap`): every stage holds its blocks' frozen weights and their adapters, and only the adapters require
gradients. This module adds what the pipeline needs around that:

- :func:`wrap`: ``peft`` on a model built on the meta device, from ``lora=True`` (``LoraConfig(r=8, lora_alpha=16,
  target_modules="all-linear")``), a dict of ``LoraConfig`` fields, a ``LoraConfig``, or a ``save_pretrained``
  directory of an adapter (its config, and later its tensors);
- :func:`adapter_init`: ``peft``'s own initialisation of a stage's new adapters when the stage materialises them;
- :class:`PeftWeights`: each stage reads its frozen base tensors from the base checkpoint (under their names before
  ``peft``) and its adapters from an adapter directory, only its own;
- :func:`save_adapters`: ``PeftModel.save_pretrained`` of the adapters every stage holds, written once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch
from torch import Tensor, nn

from lightning_gpipe.hf.weights import SafetensorsWeights

try:
    import peft
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError:  # peft is optional (the `examples` extra): LoRA needs it, the rest does not
    peft = None  # type: ignore[assignment]  # the optional module's stand-in

DEFAULT_LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
"""The ``LoraConfig`` fields of ``lora=True``: rank 8, alpha 16, every linear layer of the blocks (``peft``'s
``"all-linear"`` leaves the output head out)."""

LoraSpec = bool | str | os.PathLike | Mapping[str, Any] | Any
"""What turns LoRA on: ``True``, an adapter directory, a dict of ``LoraConfig`` fields or a ``LoraConfig``."""


def _peft() -> Any:
    if peft is None:
        raise ImportError("LoRA through the pipeline needs `peft`: pip install 'peft>=0.21' (the `examples` extra)")
    return peft


def is_peft_model(model: nn.Module) -> TypeGuard[peft.PeftModel]:
    """Whether ``model`` is a ``peft.PeftModel`` (never true when ``peft`` is not installed)."""
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_config(lora: LoraSpec) -> Any:
    """The ``peft.LoraConfig`` of ``lora`` (see :data:`LoraSpec`), ready to train (``inference_mode=False``).

    Raises:
        ValueError: for an initialisation that needs the base weights when the adapters are created (PiSSA, OLoRA,
            LoftQ, EVA..., DoRA's magnitudes): a stage creates its adapters before it reads its base weights.
        ImportError: without ``peft``.
    """
    library = _peft()
    if lora is True:
        config = library.LoraConfig(**DEFAULT_LORA)
    elif isinstance(lora, (str, os.PathLike)):
        config = library.PeftConfig.from_pretrained(str(lora))
        config.inference_mode = False
        return config  # its tensors come from the directory (PeftWeights), not from an initialisation
    elif isinstance(lora, Mapping):
        config = library.LoraConfig(**lora)
    else:
        config = lora
    if config.init_lora_weights not in (True, False, "gaussian") or getattr(config, "use_dora", False):
        raise ValueError(
            f"LoRA with init_lora_weights={config.init_lora_weights!r}, use_dora={config.use_dora}: this initialisation"
            " reads the base weights, which a stage has not read yet when it creates its adapters. Create the adapter"
            " with peft on the loaded model, save it (save_pretrained) and pass its directory as `lora`."
        )
    return config


def wrap(model: nn.Module, lora: LoraSpec) -> Any:
    """``peft.get_peft_model(model, lora_config(lora))``: works on a model built on the meta device (the adapters
    are created there too); the base weights are frozen, the adapters trainable."""
    return _peft().get_peft_model(model, lora_config(lora))


def unwrap(model: nn.Module) -> tuple[nn.Module, Callable[[nn.Module], None] | None]:
    """The ``transformers`` model inside ``model`` and :func:`adapter_init` of its adapters, or ``(model, None)``
    for a model without ``peft``."""
    if not is_peft_model(model):
        return model, None
    return model.get_base_model(), adapter_init(model)


def adapter_init(peft_model: Any) -> Callable[[nn.Module], None]:
    """A function that gives a LoRA layer's adapters ``peft``'s initialisation (``lora_A`` as ``nn.Linear``'s,
    ``lora_B`` zeros, or ``"gaussian"``), as ``get_peft_model`` gives them; other modules are left alone. For
    :attr:`HFLayer.extra_init <lightning_gpipe.hf.layer.HFLayer.extra_init>`."""
    configs = peft_model.peft_config

    def initialise(module: nn.Module) -> None:
        if isinstance(module, peft.tuners.lora.LoraLayer):
            for name in module.lora_A:
                module.reset_lora_parameters(name, configs[name].init_lora_weights)

    return initialise


def _base_renames(inner: nn.Module, adapter: str) -> list[tuple[str, str | None]]:
    """``(prefix in the peft model, prefix in the base checkpoint or None)``, longest first: a tuner layer's
    ``base_layer`` is the original module; the rest of a tuner layer (its adapters) is in no base checkpoint; a
    ``modules_to_save`` copy and its original are the original module."""
    renames: list[tuple[str, str | None]] = []
    for path, module in inner.named_modules():
        if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer):
            renames += [(f"{path}.base_layer.", f"{path}."), (f"{path}.", None)]
        elif isinstance(module, AuxiliaryTrainingWrapper):
            renames += [(f"{path}.original_module.", f"{path}."), (f"{path}.modules_to_save.{adapter}.", f"{path}.")]
    return sorted(renames, key=lambda rename: -len(rename[0]))


def base_name(name: str, renames: list[tuple[str, str | None]]) -> str | None:
    """The base checkpoint's name of the peft model's tensor ``name`` (``None`` for an adapter's tensor)."""
    for prefix, replacement in renames:
        if name.startswith(prefix):
            return None if replacement is None else replacement + name[len(prefix) :]
    return name


def _peft_prefix(peft_model: Any) -> str:
    """Where the ``transformers`` model sits in the peft model's state dict (``"base_model.model."``)."""
    inner = peft_model.get_base_model()
    return next(name for name, module in peft_model.named_modules() if module is inner) + "."


def saved_names(peft_model: Any, names: Iterable[str]) -> dict[str, str]:
    """``{name in the transformers model: name in an adapter file}`` for the tensors of ``names`` that
    ``PeftModel.save_pretrained`` writes (``peft``'s own selection and renaming, applied to placeholders)."""
    prefix = _peft_prefix(peft_model)
    placeholders = {prefix + name: torch.empty(0) for name in names}
    saved = peft.get_peft_model_state_dict(peft_model, state_dict=placeholders, save_embedding_layers=False)
    by_id = {id(tensor): name for name, tensor in saved.items()}
    return {name[len(prefix) :]: by_id[id(t)] for name, t in placeholders.items() if id(t) in by_id}


class PeftWeights:
    """A ``peft`` model's tensors by name (the ``weights`` of its backbone layers): frozen base tensors from the base
    checkpoint, adapters from an adapter directory; each stage reads only the names of its own layers.

    Args:
        peft_model: the ``peft.PeftModel`` (built on the meta device).
        base: the base checkpoint (:class:`~lightning_gpipe.hf.weights.SafetensorsWeights`), or ``None`` to
            initialise the base as the model initialises new weights.
        adapters: a ``PeftModel.save_pretrained`` directory (``adapter_model.safetensors``), or ``None`` to
            initialise the adapters as ``peft`` does (:func:`adapter_init`).

    Raises:
        FileNotFoundError: if ``adapters`` holds no safetensors file.
    """

    def __init__(self, peft_model: Any, base: SafetensorsWeights | None, adapters: str | os.PathLike | None) -> None:
        inner = peft_model.get_base_model()
        self.base = base
        self.renames = _base_renames(inner, peft_model.active_adapter)
        names = list(inner.state_dict())
        self.adapter_names = saved_names(peft_model, names) if adapters is not None else {}
        self.adapters = SafetensorsWeights(Path(adapters)) if adapters is not None else None

    def provides(self, name: str) -> bool:
        """Whether this reads ``name`` (a name of the ``transformers`` model inside the peft model)."""
        if name in self.adapter_names:
            return True
        return self.base is not None and base_name(name, self.renames) is not None

    def load(self, names: Iterable[str], device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """Read the tensors of ``names`` (each :meth:`provides`) onto ``device``.

        Raises:
            KeyError: naming the names the files lack.
        """
        result = {}
        for name in names:
            if name in self.adapter_names:
                assert self.adapters is not None  # adapter names come with an adapter directory only
                result[name] = self.adapters.load([self.adapter_names[name]], device)[self.adapter_names[name]]
            else:
                stored = cast(str, base_name(name, self.renames))  # a name this provides: a base and a stored name
                result[name] = cast(SafetensorsWeights, self.base).load([stored], device)[stored]
        return result


def save_adapters(peft_model: Any, directory: str | os.PathLike, adapters: Mapping[str, Tensor]) -> Path:
    """Write ``adapters`` (``{name in the transformers model: tensor}``, every stage's together) as
    ``PeftModel.save_pretrained`` does: ``adapter_model.safetensors`` and ``adapter_config.json``, which
    ``PeftModel.from_pretrained(base_model, directory)`` loads.

    Returns:
        The directory.
    """
    prefix = _peft_prefix(peft_model)
    state = {prefix + name: tensor.detach().cpu() for name, tensor in adapters.items()}
    peft_model.save_pretrained(str(directory), state_dict=state, save_embedding_layers=False)
    return Path(directory)
