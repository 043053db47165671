"""``GPipeStrategy(compile=...)``: each backbone layer of a stage compiled with :func:`torch.compile`, in place.

The stage runs its layers one at a time (:meth:`~lightning_gpipe.engine.microbatch.Partition.run`), so compiling each
layer
compiles everything the stage does with them: the forward, the re-materialization's recompute (which runs the
layers again, with autograd) and the backward (AOTAutograd compiles each layer's backward with its forward, as one
``CompiledFunctionBackward`` autograd node). The layers stay where they are, under their names: the state dict,
checkpoints (``backbone.7.weight``), the balance and the ties see the same modules and parameters.

How a layer is compiled: its ``forward`` is replaced, on the instance, by ``torch.compile`` of a small function of
this module that calls the original ``forward``. Forward hooks still run around it, uncompiled. Two details of
torch make it so rather than ``nn.Module.compile()``:

- torch's Dynamo does not start tracing in a frame of torch's own files, and ``nn.Module.compile()`` compiles the
  module's ``_call_impl`` (in ``torch/nn/modules/module.py``): on torch 2.13 a layer that is a torch module
  (``nn.Sequential``, ``nn.Linear``, ``nn.TransformerEncoderLayer``) is then silently left uncompiled. A function
  of this module is traced, and Dynamo inlines the torch code it calls.
- every layer is compiled from the same function, whose code object holds Dynamo's cache: shared, the layers of a
  backbone would exhaust its ``recompile_limit`` (8) together and the rest would run uncompiled. Each layer gets a
  cache of its own (``isolate_recompiles=True``) unless the options say otherwise; where the installed torch has no
  such option (before 2.12), each layer's function gets a code object of its own instead.

:func:`uncompile_layers` puts the layers' forwards back at teardown, so the module given back is the user's.

Zero-bubble's B/W split (:mod:`lightning_gpipe.engine.weightgrad`) composes: a compiled layer's backward node leads both
to the stage's input and to the layer's parameters, so it is a branch node; B runs it for the input gradient, W runs it
again from the kept output gradient for the parameters'. AOTAutograd compiles one backward per layer computing
all of its gradients, so B cannot leave the weight gradient out and W cannot leave the input gradient out: each
compiled layer's backward runs twice on stages that split (the results are unchanged). ZB-H1 under compile
therefore trades one extra backward per layer for its smaller bubble; docs/how-it-works.md, "torch.compile", has
the numbers. B keeps the graph for W (``retain_graph=True``), which a backward compiled with AOTAutograd's donated
buffers refuses with a RuntimeError: a stage that splits turns them off (see
:func:`compile_layer`).

Randomness: inductor draws random numbers (dropout) with its own generator, seeded from torch's, so a compiled
run's masks differ from an uncompiled run's (each is reproducible, and a recompute replays its forward's masks).
``compile={"options": {"fallback_random": True}}`` draws them as eager torch does.
"""

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_gpipe._torch import keep_donated_buffers_off

CompileOption = bool | Mapping[str, Any]
"""``compile``: ``False`` (off), ``True`` (torch.compile's defaults) or torch.compile's keyword arguments."""

COMPILE_KEYWORDS = frozenset(name for name in inspect.signature(torch.compile).parameters if name != "model")
"""The keyword arguments of :func:`torch.compile` a ``compile`` dict may give (all but the function)."""

ISOLATES = "isolate_recompiles" in COMPILE_KEYWORDS
"""Whether the installed torch's :func:`torch.compile` gives a function a recompile cache of its own."""

_BEFORE = "_lightning_gpipe_before"
"""The attribute of a compiled ``forward`` holding ``(the forward the instance held before,)`` (``(None,)``: the
class's), which marks it as ours."""


def compile_options(value: Any) -> dict[str, Any] | None:
    """The keyword arguments to compile each layer with, from a ``compile`` option ``value``; ``None`` for off.

    ``True`` gives ``{}`` (torch.compile's defaults), a mapping its own items; each layer is then compiled with
    ``isolate_recompiles=True`` added unless given (see the module docstring).

    Raises:
        ValueError: for anything but a bool or a mapping whose keys are keyword arguments of :func:`torch.compile`.
    """
    if isinstance(value, bool):
        return {} if value else None
    if not isinstance(value, Mapping):
        raise ValueError(f"{value!r} is neither a bool nor a mapping of torch.compile's keyword arguments.")
    unknown = sorted(str(key) for key in value if key not in COMPILE_KEYWORDS)
    if unknown:
        raise ValueError(
            f"{', '.join(unknown)} is not a keyword argument of torch.compile; choose among"
            f" {', '.join(sorted(COMPILE_KEYWORDS))}."
        )
    return dict(value)


def compile_layers(partition: nn.Module, options: Mapping[str, Any] | None, split_backward: bool = False) -> None:
    """Compile each direct child of ``partition`` (a stage's backbone layers) in place; nothing if ``options`` is
    ``None``. See the module docstring.

    Args:
        partition: the stage's layers (a :class:`~lightning_gpipe.engine.microbatch.Partition`).
        options: keyword arguments of :func:`torch.compile` (from :func:`compile_options`).
        split_backward: whether the stage splits its backwards into B and W (``retain_graph=True``): the layers are
            then compiled without donated buffers (see :func:`compile_layer`).
    """
    if options is None:
        return
    options = {"isolate_recompiles": True, **options} if ISOLATES else dict(options)
    for layer in partition.children():
        compile_layer(layer, options, split_backward)


def compile_layer(layer: nn.Module, options: Mapping[str, Any], split_backward: bool = False) -> None:
    """Replace ``layer``'s ``forward`` by its ``torch.compile(**options)`` on the instance (again if compiled).

    With ``split_backward``, AOTAutograd's donated buffers are turned off in this process
    (:func:`~lightning_gpipe._torch.keep_donated_buffers_off`, for every compiled function from then on, and left so): a
    backward compiled with them frees its saved intermediates as it runs, and refuses to run with
    ``retain_graph=True``, which B needs (W runs the same node again). AOTAutograd leaves them out on its own when
    the first backward it compiles keeps the graph, but not for a backward compiled earlier without, nor one loaded
    from its on-disk cache; and it checks the setting when the backward runs, so it cannot be patched around the
    compile alone.
    """
    uncompile_layer(layer)
    before = layer.__dict__.get("forward")
    original = layer.forward

    def compiled_forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    if not ISOLATES:  # Dynamo keeps its cache on the code object: one of the layer's own
        compiled_forward.__code__ = compiled_forward.__code__.replace()

    if split_backward:
        keep_donated_buffers_off()  # read when compiling, and again when a backward runs
    compiled = torch.compile(compiled_forward, **options)
    setattr(compiled, _BEFORE, (before,))
    layer.forward = compiled


def uncompile_layers(partition: nn.Module) -> None:
    """Undo :func:`compile_layers`: each child of ``partition`` runs its own ``forward`` again."""
    for layer in partition.children():
        uncompile_layer(layer)


def uncompile_layer(layer: nn.Module) -> None:
    """Give ``layer`` back the ``forward`` it had before :func:`compile_layer` (nothing if it was not compiled)."""
    if not is_compiled(layer):
        return
    (before,) = getattr(layer.__dict__["forward"], _BEFORE)
    if before is None:
        del layer.forward
    else:
        layer.forward = before


def is_compiled(layer: nn.Module) -> bool:
    """Whether ``layer`` runs a forward compiled by :func:`compile_layer`."""
    return hasattr(layer.__dict__.get("forward"), _BEFORE)
