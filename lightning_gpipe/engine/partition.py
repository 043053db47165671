"""Split a LightningModule's ``nn.Sequential`` backbone into stages, keeping parameter names.

Stage k keeps layers ``sum(balance[:k])`` to ``sum(balance[:k+1]) - 1`` under their
original names, so ``backbone.7.weight`` stays ``backbone.7.weight`` and the union
of the stages' state dicts is the full model's (with virtual stages, stage k keeps the layers of virtual stages
k, k + K, ..., one :class:`~lightning_gpipe.engine.microbatch.Partition` per model chunk, all under one module).
Other stages' layers go to the meta device (their memory is freed, their structure kept so that the split can
be undone). Modules outside the backbone that hold parameters or buffers (heads,
losses with weights) live only on the stage that ends the backbone (the last one; stage 0 in ZB-V's V); the
others hold a placeholder that names the contract if user code calls it.

A module or parameter used in several places (a layer at two backbone positions, an embedding tied to
the output head) stays one object within a stage: only what no local layer uses goes to the meta device.
Across stages each holding stage keeps its own copy (:mod:`lightning_gpipe.engine.ties` keeps them equal), and
:meth:`Split.undo` ties the names together again.
"""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from lightning_gpipe._torch import RESET_METHODS, children
from lightning_gpipe.engine.microbatch import Partition


class _LastStageOnly(nn.Module):
    """Stands, on another stage, for a module outside the backbone that lives only on the stage ending the backbone."""

    def __init__(self, name: str, stage_index: int) -> None:
        super().__init__()
        self.name, self.stage_index = name, stage_index

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"`self.{self.name}` was called on stage {self.stage_index}, before the backbone call. Modules outside the"
            " backbone live only on the stage that ends the backbone, so code before the backbone call must hold no"
            f" parameters (data preparation only). Move `{self.name}` into the backbone as its first layer, or call it"
            " after the backbone."
        )


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
        outside = [child for name, child in module.named_children() if name != backbone]
        kept = {sub for layer in [*(layers[n] for n in local), *(outside if last else [])]
                for sub in layer.modules()}  # fmt: skip
        for name in names:
            if name not in local:
                _to_meta(layers[name], kept)
        self.partition = Partition({name: layers[name] for name in local})
        self.model_chunks = [self.partition] if len(held) == 1 else [self._layers(layers) for layers in held]
        setattr(module, backbone, self.partition)
        self.freed: dict[str, nn.Module] = {}
        if not last:
            self._free_modules_outside_backbone(kept)

    def _layers(self, names: list[str]) -> Partition:
        return Partition({name: children(self.sequential)[name] for name in names})

    def _free_modules_outside_backbone(self, kept: set[nn.Module]) -> None:
        for name, child in list(self.module.named_children()):
            if name != self.backbone and _holds_state(child):
                _to_meta(child, kept)
                self.freed[name] = child
                setattr(self.module, name, _LastStageOnly(name, self.stage_index))

    def undo(self, full_state: dict[str, Tensor] | None = None) -> None:
        """Put the original backbone and modules back in place.

        Args:
            full_state: the whole model's state dict (the union of all stages'); when given, the
                other stages' layers are materialised on the CPU and loaded from it, so the module is
                whole again. Without it they stay on the meta device.
        """
        setattr(self.module, self.backbone, self.sequential)
        for name, child in self.freed.items():
            setattr(self.module, name, child)
        if full_state is not None:
            for child in [*self.sequential, *self.freed.values()]:
                if any(t.is_meta for t in [*child.parameters(), *child.buffers()]):
                    child.to_empty(device=torch.device("cpu"))
            self.module.load_state_dict(full_state)
        # one parameter under several names again: this stage's copy, if it held one
        _retie(self.module, self._aliases, lambda copies: next((c for c in copies if not c.is_meta), copies[0]))


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

    Raises:
        ValueError: if a meta tensor belongs to a module with no reset method, directly or
            through an ancestor (its values could not be initialised).
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
    _retie(module, aliases, lambda copies: copies[0])  # each module got its own new tensor: one again
    for sub in reversed(resets):
        reset = next((getattr(sub, name) for name in RESET_METHODS if hasattr(sub, name)), None)
        if reset is not None:
            with torch.no_grad():
                reset()


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
