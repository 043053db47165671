"""The one place the package touches torch's private API.

A pipeline needs a few things torch keeps to itself: the dispatch mode and pytree helpers that count and walk an
operator's tensors, the saved tensors of an autograd node (to split a linear layer's backward), a module's children
by position (a layer at two positions at both), a module's buffer set as saved or not as it was, the batch-norm base
class, AOTAutograd's donated buffers, the default store of the process group, a checkpoint read without a template,
a random sampler's requested length, the gradient scaler's per-device overflow flags, and FSDP2's per-backward
callbacks and state (the pipeline's backwards are several autograd calls, and FSDP2 has no public inverse). torch
may rename or remove any of them in any release, so every use lives here, one small function (or constant) each,
whose docstring says why the package needs it and on which torch versions it was checked. No other module of
``lightning_gpipe`` imports a private torch name or reads or writes a private attribute of a torch object;
``tests/unit/test_private_api.py`` fails when one does.

Checked on: torch 2.13.0 (``pyproject.toml`` asks for ``torch>=2.13,<2.14``).

The package's floor: it imports nothing of the package, and every layer may import it (``tests/unit/test_layout.py``).

When torch changes: read each name's counterpart in the new version's source (the names are in the bodies), adapt
the body here (keeping its contract, so that the callers stay as they are), run the unit tests and the distributed
tests (``tests/distributed/test_sharding.py`` for FSDP2), then add the version to every "Checked on" line you
verified and widen the pin in ``pyproject.toml``.
"""

import os
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import RandomSampler

# ----------------------------------------------------------------------------------------- operators and autograd

DispatchMode = TorchDispatchMode
"""torch's mode that sees every operator call below autograd (``torch.utils._python_dispatch.TorchDispatchMode``).

Why: :class:`~lightning_gpipe.engine.events.PeakBytes` counts the bytes of every operator's outputs, the backward's
included, on any device (the CPU has no allocator statistics); ``torch.overrides.TorchFunctionMode``, the public one,
sits above autograd and does not see the backward's operators.

Checked on: torch 2.13.0."""

tree_flatten = _pytree.tree_flatten
"""torch's pytree flattening (``torch.utils._pytree.tree_flatten``): the leaves of a nested value and its structure.

Why: the batch agreement digests a batch's structure and leaves as torch's own collate and ``DataLoader`` see them
(every container type torch registers), and :class:`~lightning_gpipe.engine.events.PeakBytes` walks an operator's
outputs; torch has no public pytree module.

Checked on: torch 2.13.0."""

tree_leaves = _pytree.tree_leaves
"""torch's pytree leaves (``torch.utils._pytree.tree_leaves``): the leaves of a nested value, in order.

Why: the planner's profile of what runs after the backbone tells the batch's own tensors (which exist before it runs)
from the ones it makes; torch has no public pytree module.

Checked on: torch 2.13.0."""


def saved(node: Any, name: str) -> Any:
    """What the autograd node ``node`` saved for its backward under ``name`` (its attribute ``_saved_<name>``, e.g.
    ``saved(node, "mat1")`` of an ``AddmmBackward0``).

    Why: a plain linear layer's weight gradient (W, :mod:`~lightning_gpipe.engine.weightgrad`) is computed from the
    input its ``addmm`` or ``mm`` node saved, and only an ``addmm`` with ``alpha`` and ``beta`` of 1 is a plain one;
    torch's autograd notes document the ``_saved_`` attributes, but they have no public name.

    Checked on: torch 2.13.0.
    """
    return getattr(node, f"_saved_{name}")


def keep_donated_buffers_off() -> None:
    """Turn AOTAutograd's donated buffers off in this process (``torch._functorch.config.donated_buffer = False``),
    for every function compiled from then on, and leave them so.

    Why: a backward compiled with them frees its saved intermediates as it runs and refuses ``retain_graph=True``,
    which a split backward needs (W runs the node B ran); AOTAutograd reads the setting when compiling and again when
    a backward runs (:func:`~lightning_gpipe.engine.compilation.compile_layer`).

    Checked on: torch 2.13.0.
    """
    torch._functorch.config.donated_buffer = False


def version(tensor: Tensor) -> int:
    """How many times ``tensor``'s data was modified in place: its version counter (``tensor._version``), shared with
    its views; a new tensor (a ``clone()``) starts at 0.

    Why: a stage hands its layers copies of an input they modify in place, found by whether a copy's counter moved
    (:meth:`~lightning_gpipe.engine.microbatch.Partition.run`); torch has no public reader of the counter.

    Checked on: torch 2.13.0."""
    return tensor._version


def view_base(tensor: Tensor) -> Tensor | None:
    """The tensor ``tensor`` is a view of (``tensor._base``), ``None`` where it is not a view.

    Why: activation offload (:mod:`~lightning_gpipe.engine.offload`) never moves a parameter, and autograd saves views
    of parameters (a linear layer's ``weight.t()``); under FSDP2 the gathered parameters exist only while their layer
    runs, so a saved view is told from an activation by its base, not by a set of storages made beforehand. torch has
    no public name for a view's base.

    Checked on: torch 2.13.0."""
    return tensor._base


# ------------------------------------------------------------------------------------------------------ modules


@overload
def children(module: nn.Sequential) -> dict[str, nn.Module]:
    """An ``nn.Sequential``'s layers by position, never ``None`` (see the implementation below)."""


@overload
def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """Any module's children by name, ``None`` entries included (see the implementation below)."""


def children(module: nn.Module) -> dict[str, nn.Module | None] | dict[str, nn.Module]:
    """``module``'s children by name, in order, as the module holds them (``module._modules``, the dictionary itself):
    a child registered under two names appears under both, and a name registered as ``None`` is there too (never in
    an ``nn.Sequential``).

    Why: a backbone's layers are its positions (a layer used at two positions is two layers of the pipeline, and
    a stage's part is a run of positions); ``named_children()`` drops a child's second name and ``None`` entries.

    Checked on: torch 2.13.0.
    """
    return module._modules


BatchNormBase = _BatchNorm
"""torch's base class of ``nn.BatchNorm1d``, ``2d`` and ``3d`` (``torch.nn.modules.batchnorm._BatchNorm``).

Why: :class:`~lightning_gpipe.engine.batchnorm.DeferredBatchNorm` is a batch norm (``isinstance`` checks, the
parameters, buffers and ``extra_repr`` of one) of any of the three dimensions; it implements the base's input check,
``_check_input_dim``, as the class it wraps does.

Checked on: torch 2.13.0."""

RESET_METHODS = ("reset_parameters", "_reset_parameters")
"""The methods torch's modules fill their parameters and buffers with: ``reset_parameters``, or
``nn.MultiheadAttention``'s private ``_reset_parameters``.

Why: a module built on the meta device is initialised on its stage by its own method (and one whose tensors come
from a checkpoint is not initialised at all).

Checked on: torch 2.13.0."""


# -------------------------------------------------------------------------------------- data, scaler, processes


def set_buffer(module: nn.Module, name: str, tensor: Tensor) -> None:
    """Make ``tensor`` ``module``'s existing buffer ``name`` (``module._buffers[name]``), whether it is saved as it
    was.

    Why: a Hugging Face layer lends a model's module the buffers the layer holds for it (a stack's unsaved tables its
    forward reads, :class:`~lightning_gpipe.hf.decoder_stack.StackDecoderEmbedding`); ``register_buffer`` would also
    set whether the buffer is saved, and torch keeps that set private.

    Checked on: torch 2.13.0."""
    module._buffers[name] = tensor


def requested_samples(sampler: RandomSampler) -> int | None:
    """The ``num_samples`` a ``RandomSampler`` was created with (``sampler._num_samples``; ``None``: the dataset's
    length, read when it is iterated).

    Why: a shuffling loader gets a seeded sampler that reads the same order on every stage only when it draws each
    sample once (no ``num_samples`` of its own); the public ``num_samples`` is the dataset's length then too.

    Checked on: torch 2.13.0.
    """
    return sampler._num_samples


def scaler_device(scaler: torch.amp.GradScaler) -> str:
    """The device type a ``GradScaler`` was created for (``scaler._device``).

    Why: the shared scaler of a pipeline is made like the user's (device, settings, state); ``GradScaler`` has no
    public accessor for its device.

    Checked on: torch 2.13.0.
    """
    return scaler._device


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[Any, Tensor]:
    """The overflow flags ``scaler.unscale_(optimizer)`` left, one tensor per device (``scaler._per_optimizer_states
    [id(optimizer)]["found_inf_per_device"]``; empty before ``unscale_``), which its ``step`` reads.

    Why: a pipeline's stages skip a step together: the shared scaler agrees on the flags across the stages and writes
    the agreed value back before ``step`` reads them.

    Checked on: torch 2.13.0.
    """
    return scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]


def default_store() -> dist.Store:
    """The key-value store of the default process group (``torch.distributed.distributed_c10d._get_default_store``).

    Why: the run's job (:class:`~lightning_gpipe.faults.job.Job`) reports failures and progress through the store
    the process group was made with (a channel that works while a collective hangs), which every process reaches
    with no address of its own; torch has no public accessor for it.

    Checked on: torch 2.13.0.
    """
    return dist.distributed_c10d._get_default_store()


def read_checkpoint(directory: str | os.PathLike) -> dict[str, Any]:
    """The whole state a torch.distributed.checkpoint directory holds, read in this process without a process group
    and without a template (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``: the nested dictionary rebuilt
    from the checkpoint's metadata), its tensors on the CPU.

    Why: ``python -m lightning_gpipe.consolidate`` writes a sharded checkpoint as one file without the model; the
    public ``torch.distributed.checkpoint.load`` fills only the keys of a given template, and
    ``format_utils.dcp_to_torch_save`` (torch's own consolidation, built on the same pair) writes a file instead.

    Checked on: torch 2.13.0.
    """
    state: dict[str, Any] = {}
    reader = FileSystemReader(directory)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


# ------------------------------------------------------------------------------------------------------- FSDP2


def _fsdp_state(module: Any) -> Any:
    """The ``FSDPState`` of a module ``fully_shard`` was applied to (the state its ``contract`` decorator keeps)."""
    return fully_shard.state(module)  # type: ignore[attr-defined]  # set by torch's contract decorator


def make_fsdp_root(root: FSDPModule) -> None:
    """Make ``root`` the FSDP2 root of its units now (``FSDPState._lazy_init``), as its first forward would.

    Why: a stage's FSDP2 root is never called (its units run in the engine's micro-batches), and a unit whose forward
    ran first would make itself a root instead.

    Checked on: torch 2.13.0.
    """
    _fsdp_state(root)._lazy_init()


def fsdp_post_backward(root: FSDPModule) -> None:
    """Every FSDP2 unit's post-backward under ``root`` (``FSDPParamGroup.post_backward``: the reduce-scatter if the
    gradients sync, then freeing the gathered parameters) and the root's final callback
    (``FSDPState._root_post_backward_final_callback``: waiting for the reductions, resetting the step's state).

    Why: FSDP2 runs these after a backward it sees whole; a pipeline stage's backwards are several autograd calls, one
    per micro-batch, and the step ends after the last (``FullyShardedStage.finish_backward``).

    Checked on: torch 2.13.0.
    """
    state = _fsdp_state(root)
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def remove_fully_shard(root: nn.Module) -> None:
    """Undo ``fully_shard`` on ``root`` and its units, but their parameters: FSDP2's forward hooks and state-dict
    hooks removed, each unit's class back as before (its ``FSDP<Class>`` subclass dropped), its entries in the
    composable API's state and registry (``STATE_KEY``, ``REGISTRY_KEY``, ``_module_state_mapping``) and FSDP's marks
    (``_is_fsdp_managed_module``, ``_fsdp_use_orig_params``) gone.

    Why: after a completed fit the user's module leaves the run plain (as DDP leaves it), so that a later run may shard
    it again; FSDP2 has no public inverse.

    Checked on: torch 2.13.0.
    """
    for state in {_fsdp_state(module) for module in root.modules() if isinstance(module, FSDPModule)}:
        _remove_state(state)
    for module in root.modules():
        module.__dict__.pop("_is_fsdp_managed_module", None)
        module.__dict__.pop("_fsdp_use_orig_params", None)


def _remove_state(state: Any) -> None:
    """Remove one ``FSDPState`` from its modules (see :func:`remove_fully_shard`)."""
    handles = [state._pre_forward_hook_handle, state._post_forward_hook_handle]
    for group in state._fsdp_param_groups:
        handles += [*group._module_to_pre_save_state_dict_hook_handle.values()]
        handles += [*group._module_to_pre_load_state_dict_hook_handle.values()]
        handles += [parameter._post_load_hook_handle for parameter in group.fsdp_params]
    for handle in handles:
        handle.remove()
    for module in state._modules:
        fsdp_class, original = type(module).__bases__
        assert fsdp_class is FSDPModule  # fully_shard made the class (FSDPModule, original)
        module.__class__ = original
        module.__dict__[STATE_KEY] = {
            key: value for key, value in module.__dict__[STATE_KEY].items() if value is not state
        }
        module.__dict__[REGISTRY_KEY].pop("fully_shard", None)
        _module_state_mapping.pop(module, None)


# ----------------------------------------------------------------------------------------------- tensor parallelism


def forward_hooks(root: nn.Module) -> set[tuple[int, int]]:
    """Every forward and forward-pre hook registered on ``root`` and its submodules, as ``(id(module), hook id)``
    (the keys of ``nn.Module._forward_hooks`` and ``_forward_pre_hooks``, unique per process).

    Why: ``parallelize_module`` (``distribute_module``) registers a layer's input and output conversions as forward
    hooks and keeps no handle; after a completed fit the user's module leaves the run plain, so the hooks it added are
    told from the user's by comparing what was there before (:func:`remove_forward_hooks`).

    Checked on: torch 2.13.0.
    """
    return {
        (id(module), key) for module in root.modules() for key in [*module._forward_hooks, *module._forward_pre_hooks]
    }


def remove_forward_hooks(root: nn.Module, hooks: set[tuple[int, int]]) -> None:
    """Remove from ``root`` and its submodules the forward and forward-pre hooks in ``hooks`` (see
    :func:`forward_hooks`), with their entries in the registries of hooks that take keyword arguments or always run.

    Why: the hooks ``parallelize_module`` added convert a layer's input and output to and from ``DTensor`` over the
    run's mesh; after the run the module is plain again, and ``RemovableHandle`` needs the handle torch did not keep.

    Checked on: torch 2.13.0.
    """
    for module in root.modules():
        for registry in (module._forward_hooks, module._forward_pre_hooks):
            for key in [key for key in registry if (id(module), key) in hooks]:
                del registry[key]
                module._forward_hooks_with_kwargs.pop(key, None)
                module._forward_hooks_always_called.pop(key, None)
                module._forward_pre_hooks_with_kwargs.pop(key, None)
