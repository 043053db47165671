"""Split a LightningModule's ``nn.Sequential`` backbone into stages, keeping parameter names.

Stage k keeps layers ``sum(balance[:k])`` to ``sum(balance[:k+1]) - 1`` under their
original names, so ``backbone.7.weight`` stays ``backbone.7.weight`` and the union
of the stages' state dicts is the full model's (with virtual stages, stage k keeps the layers of virtual stages
k, k + K, ..., one :class:`~lightning_gpipe.engine.microbatch.Partition` per model chunk, all under one module).
Other stages' layers go to the meta device (their memory is freed, their structure kept so that the split can
be undone). Modules outside the backbone that hold parameters or buffers (heads,
losses with weights) live only on the stage that ends the backbone (the last one; stage 0 in ZB-V's V); the
others hold a placeholder that names the contract if user code calls it (reading a method of it works: it raises
only if called). A module that keeps the whole model beside its backbone (``self.model``, whose ``blocks`` are the
backbone) still holds on each stage only the stage's layers: where another attribute refers to the backbone, the
stage's partition stands, and where it refers to another stage's layer, a placeholder (:func:`backbone_aliases`
tells the ties the same).

A module or parameter used in several places (a layer at two backbone positions, an embedding tied to
the output head) stays one object within a stage: only what no local layer uses goes to the meta device.
Across stages each holding stage keeps its own copy (:mod:`lightning_gpipe.engine.ties` keeps them equal), and
:meth:`Split.undo` ties the names together again.
"""

import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import RESET_METHODS, children
from lightning_gpipe.engine.microbatch import Partition


class _Placeholder(nn.Module):
    """Stands, on a stage, for a module the stage does not hold; holds none of its tensors, only, where the module
    referred to the stage's own backbone layers, those (:class:`Split` hangs them there).

    Calling it raises :meth:`_message`. Reading one of the real module's public attributes works where that is
    harmless: a plain value (a number, a string, a config) is the real one; a submodule is a placeholder too; a method
    is a callable that raises :meth:`_message` only if called, so ``self.model.forward_head(self.backbone(x))``,
    which reads ``forward_head`` before the backbone call, runs on every stage (the backbone call ends the step on the
    stages that do not hold the module); reading a tensor raises :meth:`_message` at once, as an ``AttributeError``
    (the tensor is not on this stage: ``hasattr`` and ``getattr`` with a default see it missing, as they always did).

    Args:
        path: the module's attribute path in the LightningModule (``"model"``, ``"model.blocks.3"``).
        stage_index: this stage.
        real: the module it stands for (not registered: its tensors are not this stage's).
    """

    def __init__(self, path: str, stage_index: int, real: nn.Module) -> None:
        super().__init__()
        self._path, self._stage_index = path, stage_index
        self.__dict__["_real"] = real  # kept out of the module tree

    def _message(self, attr: str | None, verb: str) -> str:
        """Why ``self.<path>.<attr>`` (``attr`` ``None``: the module itself) cannot be ``verb`` (``"called"``,
        ``"read"``) here, and the fix."""
        raise NotImplementedError

    def _subject(self, attr: str | None) -> str:
        """``self.<path>.<attr>`` in backquotes."""
        return f"`self.{self._path}{'' if attr is None else '.' + attr}`"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Raise :meth:`_message`: the module is not on this stage."""
        raise RuntimeError(self._message(None, "called"))

    def __getattr__(self, attr: str) -> Any:
        try:
            return super().__getattr__(attr)
        except AttributeError:
            if attr.startswith("_"):  # torch's and Python's own probes of a module
                raise
        value = getattr(self.__dict__["_real"], attr)  # an AttributeError names the real class
        if isinstance(value, Tensor):  # an AttributeError, as before: `getattr(self.head, "weight", None)` is None
            raise AttributeError(self._message(attr, "read"))
        if isinstance(value, nn.Module):
            return type(self)(f"{self._path}.{attr}", self._stage_index, value)
        if not callable(value):
            return value
        message = self._message(attr, "called")

        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(message)

        return unavailable


class _LastStageOnly(_Placeholder):
    """Stands, on another stage, for a module outside the backbone that lives only on the stage ending the backbone."""

    def _message(self, attr: str | None, verb: str) -> str:
        """Why the module is not here, and the fix."""
        return (
            f"{self._subject(attr)} was {verb} on stage {self._stage_index}, before the backbone call. Modules outside"
            f" the backbone (`self.{self._path}`) live only on the stage that ends the backbone, so code before the"
            " backbone call must hold no parameters (data preparation only). Move what it runs into the backbone as"
            f" its first layer, or use {self._subject(attr)} after the backbone call."
        )


class _ElsewhereLayer(_Placeholder):
    """Stands, inside a module outside the backbone (``self.model.blocks.3`` of a module that keeps the whole model),
    for a backbone layer another stage runs."""

    def _message(self, attr: str | None, verb: str) -> str:
        """Why the layer is not here, and the fix."""
        return (
            f"{self._subject(attr)} was {verb} on stage {self._stage_index}, which does not hold it:"
            f" `self.{self._path}` is a layer of the pipelined backbone that another stage runs, and each stage holds"
            " only its own backbone layers, wherever else the module refers to them. Run the backbone's layers through"
            " the backbone call only."
        )


class _Reference(NamedTuple):
    """A place where a module outside the backbone refers to the backbone or to one of its layers."""

    path: str  # its attribute path in the LightningModule ("model.blocks")
    parent: nn.Module  # the module that holds it
    name: str  # its name in ``parent``
    target: nn.Module  # the backbone or the layer


class Split:
    """A LightningModule split for one stage, and how to undo it.

    Args:
        module: the LightningModule; changed in place.
        backbone: attribute name of its ``nn.Sequential`` backbone.
        balance: layers per (virtual) stage (validated, see :func:`lightning_gpipe.planning.balance.resolve_balance`).
        stage_index: this process's pipeline rank.
        num_stages: K, the pipeline's stages (processes); ``None`` (default): ``len(balance)``. With fewer,
            ``balance`` splits the backbone into ``len(balance)`` virtual stages and this stage holds virtual stages
            ``stage_index``, ``stage_index + K``, ... (its model chunks).
        virtual: the virtual stages this stage holds, in model chunk order, where they are placed otherwise (in a V:
            :meth:`Topology.virtual_of <lightning_gpipe.engine.topology.Topology.virtual_of>`); ``None`` (default): as
            ``num_stages`` says. The stage that holds the last one holds the modules outside the backbone.

    Attributes:
        partition: every layer this stage holds, under its original name (in backbone order), installed as the
            module's backbone.
        model_chunks: one :class:`~lightning_gpipe.engine.microbatch.Partition` per model chunk, in model chunk order
            (``[partition]`` with one per stage); each runs its virtual stage's layers.
        replaced: the places where the modules outside the backbone referred to the backbone or a layer of another
            stage, now the partition or a placeholder (put back by :meth:`undo`).
    """

    def __init__(
        self,
        module: nn.Module,
        backbone: str,
        balance: Sequence[int],
        stage_index: int,
        num_stages: int | None = None,
        virtual: Sequence[int] | None = None,
    ) -> None:
        self.module, self.backbone, self.stage_index = module, backbone, stage_index
        self.sequential: nn.Sequential = getattr(module, backbone)
        self._aliases = _aliases(module)
        layers = children(self.sequential)
        names = list(layers)
        num_stages = len(balance) if num_stages is None else num_stages
        virtual = range(stage_index, len(balance), num_stages) if virtual is None else virtual
        starts = [sum(balance[:s]) for s in range(len(balance))]
        held = [names[starts[s] : starts[s] + balance[s]] for s in virtual]
        local = [name for layers in held for name in layers]
        last = len(balance) - 1 in virtual
        reached, references = _outside(module, backbone)
        kept = {sub for name in local for sub in layers[name].modules()} | (reached if last else set())
        for name in names:
            if name not in local:
                _to_meta(layers[name], kept)
        self.partition = Partition({name: layers[name] for name in local})
        self.model_chunks = [self.partition] if len(held) == 1 else [self._layers(layers) for layers in held]
        setattr(module, backbone, self.partition)
        self.freed: dict[str, nn.Module] = {}
        if not last:
            self._free_modules_outside_backbone(kept)
        own = {layers[name] for name in local}
        self.replaced = self._replace_references(references, {layers[name] for name in names} - own, own)

    def _replace_references(
        self, references: list[_Reference], foreign: set[nn.Module], own: set[nn.Module]
    ) -> list[_Reference]:
        """Where the modules outside the backbone refer to the backbone, put this stage's partition, and where they
        refer to a layer another stage holds, a placeholder; what was replaced. In a freed module's placeholder,
        this stage's partition and layers are hung where the module referred to them (:meth:`_graft`)."""
        replaced = []
        for reference in references:
            target = self.partition if reference.target is self.sequential else reference.target
            if reference.path.split(".")[0] in self.freed:
                if target is self.partition or target in own:
                    self._graft(reference.path, target)
                continue
            if reference.target is self.sequential:
                setattr(reference.parent, reference.name, self.partition)
            elif reference.target in foreign:
                stand_in = _ElsewhereLayer(reference.path, self.stage_index, reference.target)
                setattr(reference.parent, reference.name, stand_in)
            else:
                continue
            replaced.append(reference)
        return replaced

    def _graft(self, path: str, target: nn.Module) -> None:
        """Hang ``target`` (this stage's partition or one of its layers) at ``path`` below the placeholder of the freed
        module that referred to it there (placeholders in between), so that the stage's state dict names its tensors
        there too, as the whole module's does: the stages' state dicts together are the whole module's."""
        first, *middle, name = path.split(".")
        holder, real = getattr(self.module, first), self.freed[first]
        for part in middle:
            first, real = f"{first}.{part}", real.get_submodule(part)
            if part not in children(holder):  # (`add_module` would see the placeholder's stand-in attribute)
                children(holder)[part] = _LastStageOnly(first, self.stage_index, real)
            holder = children(holder)[part]
        children(holder)[name] = target

    def _layers(self, names: list[str]) -> Partition:
        return Partition({name: children(self.sequential)[name] for name in names})

    def _free_modules_outside_backbone(self, kept: set[nn.Module]) -> None:
        for name, child in list(self.module.named_children()):
            elsewhere = child is self.sequential  # the backbone under another name: the partition stands there too
            if name != self.backbone and not elsewhere and _holds_state(child):
                _to_meta(child, kept)
                self.freed[name] = child
                setattr(self.module, name, _LastStageOnly(name, self.stage_index, child))

    def undo(self, full_state: dict[str, Tensor] | None = None) -> None:
        """Put the original backbone and modules back in place.

        Args:
            full_state: the whole model's state dict and its buffers that no state dict holds (the union of all
                stages', by name); when given, each tensor of the other stages' layers becomes the one it names
                there, and the module is loaded from it (strictly: a state-dict entry it lacks raises), so the module
                is whole again. A tensor it does not name stays on the meta device, where using it raises. Without
                it the other stages' tensors stay on the meta device.
        """
        setattr(self.module, self.backbone, self.sequential)
        for name, child in self.freed.items():
            setattr(self.module, name, child)
        for reference in self.replaced:
            setattr(reference.parent, reference.name, reference.target)
        if full_state is not None:
            _fill_meta(self.module, full_state)
            saved = self.module.state_dict(keep_vars=True)
            self.module.load_state_dict({key: value for key, value in full_state.items() if key in saved})
        # one parameter under several names again: this stage's copy, if it held one
        _retie(self.module, self._aliases, lambda copies: next((c for c in copies if not c.is_meta), copies[0]))


def _outside(module: nn.Module, backbone: str) -> tuple[set[nn.Module], list[_Reference]]:
    """The modules outside the backbone: those reached from the LightningModule's other attributes without passing
    through the backbone or one of its layers (an attribute that is itself a layer, a head tied to one, included),
    and the places where, below them, they refer to the backbone or a layer (``self.model.blocks`` of a module whose
    backbone is ``self.model.blocks``, or a container holding its layers), in module order."""
    sequential = getattr(module, backbone)
    targets = {sequential, *children(sequential).values()}
    reached: set[nn.Module] = set()
    references: list[_Reference] = []
    pending = deque((name, module, name, child) for name, child in children(module).items() if name != backbone)
    while pending:
        path, parent, name, child = pending.popleft()
        if child is None or child in reached:
            continue
        if child in targets and (child is sequential or parent is not module):
            references.append(_Reference(path, parent, name, child))
            continue
        reached.add(child)
        pending += [(f"{path}.{key}", child, key, sub) for key, sub in children(child).items()]
    return reached, references


def backbone_aliases(module: nn.Module, backbone: str) -> dict[str, str | None]:
    """Where the whole ``module``'s other attributes refer to its backbone or a backbone layer (see
    :class:`Split`): each path (``"model.blocks"``) and the layer's name in the backbone, or ``None`` where it is the
    backbone itself (its layers' names follow the path). A name below a path is held by the stage of that layer."""
    names = {layer: name for name, layer in reversed(children(getattr(module, backbone)).items())}
    return {ref.path: names.get(ref.target) for ref in _outside(module, backbone)[1]}


def is_whole(module: nn.Module) -> bool:
    """Whether ``module`` holds every tensor (none of its parameters and buffers is on the meta device)."""
    return not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate ``module``'s meta-device parameters and buffers on ``device`` and initialise them.

    Modules created on the meta device (in ``configure_model``, or under
    ``Trainer.init_module(empty_init=True)``) hold no memory; after the split each stage calls
    this on its own part, so no process ever holds the whole model. Every module whose
    tensors were on the meta device is initialised with its ``reset_parameters()`` (or
    ``_reset_parameters()``), children before parents as in construction, so a parent's
    reset (e.g. ``nn.MultiheadAttention``'s) has the last word. A parameter used by several of
    its modules (weights tied on one stage) stays one parameter.

    Each allocated tensor is first filled with a value no initialisation writes (:func:`_poison`): one the resets
    leave unwritten holds NaN, not memory's leftovers, and a buffer no checkpoint can fill (``persistent=False``: a
    positional table computed in ``__init__``) raises here.

    Raises:
        ValueError: if a meta tensor belongs to a module with no reset method, directly or
            through an ancestor (its values could not be initialised), or a buffer registered with
            ``persistent=False`` is left unwritten by the resets, naming it.
    """
    meta = [sub for sub in module.modules() if any(t.is_meta for t in _own_tensors(sub))]
    if not meta:
        return
    covered = _covered_by_reset(module)
    uncovered = [sub for sub in meta if sub not in covered]
    if uncovered:
        names = {sub: name for name, sub in module.named_modules()}
        raise ValueError(
            f"`{names[uncovered[0]] or type(module).__name__}` ({type(uncovered[0]).__name__}) was created on the"
            " meta device but has no `reset_parameters()` to initialise it on its stage. Give the module a"
            " `reset_parameters()` that fills its parameters and buffers, or create it outside `configure_model`."
        )
    resets = [sub for sub in module.modules() if any(t.is_meta for t in [*sub.parameters(), *sub.buffers()])]
    aliases = _aliases(module)
    for sub in meta:
        sub.to_empty(device=device, recurse=False)
        _poison(sub)
    _retie(module, aliases, lambda copies: copies[0])  # each module got its own new tensor: one again
    for sub in reversed(resets):
        reset = next((getattr(sub, name) for name in RESET_METHODS if hasattr(sub, name)), None)
        if reset is not None:
            with torch.no_grad():
                reset()
    _check_unsaved_buffers_filled(module, meta)


def _poison(module: nn.Module) -> None:
    """Fill ``module``'s own tensors with a value no initialisation writes (:func:`_poison_of`)."""
    with torch.no_grad():
        for tensor in _own_tensors(module):
            if (value := _poison_of(tensor)) is not None:
                tensor.fill_(value)


def _poison_of(tensor: Tensor) -> float | int | None:
    """The value :func:`_poison` fills ``tensor`` with: NaN (floating point), the type's smallest value (``int32``,
    ``int64``); ``None`` for other types, left as they are."""
    if tensor.is_floating_point() or tensor.is_complex():
        return math.nan
    return torch.iinfo(tensor.dtype).min if tensor.dtype in (torch.int32, torch.int64) else None


def _poisoned(tensor: Tensor) -> Tensor:
    """Whether any element of ``tensor`` still holds :func:`_poison`'s value (a 0-d bool tensor)."""
    value = _poison_of(tensor)
    if value is None:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    return (tensor.isnan() if math.isnan(value) else tensor == value).any()


def _check_unsaved_buffers_filled(module: nn.Module, materialized: list[nn.Module]) -> None:
    """Raise if a buffer registered with ``persistent=False`` of the ``materialized`` submodules of ``module`` is
    still :func:`_poisoned` after the resets (one host read for all of them).

    Raises:
        ValueError: naming the first such buffer and the fix.
    """
    names = {sub: name for name, sub in module.named_modules()}
    unsaved = []
    for sub in materialized:
        saved = sub.state_dict(keep_vars=True)
        own = sub.named_buffers(recurse=False)
        unsaved += [(f"{names[sub]}.{name}".lstrip("."), buffer) for name, buffer in own if name not in saved]
    poisoned = torch.stack([_poisoned(buffer) for _, buffer in unsaved]).tolist() if unsaved else []
    name = next((name for (name, _), unfilled in zip(unsaved, poisoned) if unfilled), None)
    if name is None:
        return
    raise ValueError(
        f"`{name}`, a buffer registered with persistent=False, was created on the meta device and its module's"
        " `reset_parameters()` does not fill it, so its stage would compute with no values in it (no checkpoint"
        " holds such a buffer either). Fill it in `reset_parameters()`, or create the module outside"
        " `configure_model`."
    )


def _fill_meta(module: nn.Module, values: dict[str, Tensor]) -> None:
    """Make each meta-device parameter and buffer of ``module`` that ``values`` names (by its name in ``module``)
    that value, in the meta tensor's dtype (a parameter keeps its ``requires_grad``); the others stay on the meta
    device."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        if not tensor.is_meta or name not in values:
            continue
        value = values[name].to(dtype=tensor.dtype)
        owner, _, attr = name.rpartition(".")
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        setattr(module.get_submodule(owner), attr, value)


def _own_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


def _covered_by_reset(module: nn.Module) -> set[nn.Module]:
    """Modules that have a reset method or lie below one that has."""
    covered: set[nn.Module] = set()
    for sub in module.modules():
        if sub not in covered and any(hasattr(sub, name) for name in RESET_METHODS):
            covered.update(sub.modules())
    return covered


def _aliases(module: nn.Module) -> list[list[str]]:
    """The names of each parameter that has several (tied or shared), in module order."""
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _retie(module: nn.Module, aliases: list[list[str]], pick: Callable[[list[nn.Parameter]], nn.Parameter]) -> None:
    """Make each group of ``aliases`` (names of one parameter) one parameter again: the one ``pick`` chooses of the
    copies the names now lead to."""
    for names in aliases:
        shared = pick([module.get_parameter(name) for name in names])
        for name in names:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner).register_parameter(attr, shared)


def _to_meta(module: nn.Module, kept: set[nn.Module]) -> None:
    """Move the parameters and buffers of ``module`` and its submodules to the meta device, except those of the
    submodules in ``kept`` (used on this stage too). A parameter shared with a kept module is replaced in the
    moved module's own slot only, so the kept module's stays."""
    for sub in module.modules():
        if sub not in kept:
            sub.to_empty(device="meta", recurse=False)


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
