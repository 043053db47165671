"""Which of a module's values are current on each process, between the runs of one script.

A script may run several times on one module (``fit``, then ``test`` or ``predict``, or ``fit`` again), each run
splitting it into stages. After a run, a process holds the latest values of the tensors its stage held; global rank 0
gets every stage's back when the module was whole, and every other tensor of a process is stale: the values it started
with, the placeholder memory Lightning's teardown needs (``to_empty``), or the meta device. A later run with another
split (another ``balance`` or number of stages, a V schedule's head on stage 0, the re-split of ``balance="time"``)
hands a process tensors its stage did not hold before; computing with their stale values would be a silent wrong
result. So :func:`mark_current` records, at the end of a run, which values (state-dict entries and the buffers no
state dict holds, :func:`module_values`) are current on this process;
at the start of the next, :func:`kept_values` keeps the current tensors before the split frees what the stage does not
hold, and :func:`bring_current`, after it, sends each entry a stage holds but whose value is stale there from a process
that kept it (a module never split has no record: everything is current, nothing is kept or sent).
"""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_gpipe.faults import waiting

if TYPE_CHECKING:
    from lightning_gpipe.faults import Job

_RECORD = "_gpipe_current_values"
"""Where a module keeps its record: the names of its current values (:func:`module_values`), or :data:`ALL` (absent:
the module was never split, and every process holds the same values)."""

ALL = "all"
"""The record of a process on which every entry of the module is current (global rank 0 after a whole module's run)."""


def mark_current(module: nn.Module, names: set[str] | None) -> None:
    """Record that ``module``'s values (:func:`module_values`) ``names`` are current on this process (``None``: all of
    them)."""
    module.__dict__[_RECORD] = ALL if names is None else frozenset(names)


def module_values(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s tensors whose values a run carries, by name: its state-dict entries (``keep_vars``) and the
    buffers no state dict holds (``persistent=False``: a rotary embedding's frequencies, a causal mask), which a
    stage computes with all the same."""
    values = module.state_dict(keep_vars=True)
    buffers = module.named_buffers(remove_duplicate=False)  # a buffer several modules share, under each name
    values.update((name, buffer) for name, buffer in buffers if name not in values)
    return values


def held_names(module: nn.Module) -> set[str]:
    """The names of ``module``'s values (:func:`module_values`) that this process holds (not on the meta device)."""
    return {name for name, value in module_values(module).items() if not value.is_meta}


def kept_values(module: nn.Module) -> dict[str, Tensor]:
    """The tensors of ``module`` whose values are current on this process, by state-dict name, kept (referenced, not
    copied) across the split; none for a module without a record (see the module docstring)."""
    record = module.__dict__.get(_RECORD)
    if record is None:
        return {}
    state = module_values(module)
    current = state.keys() if record == ALL else record
    return {name: value.detach() for name, value in state.items() if name in current and not value.is_meta}


def bring_current(module: nn.Module, kept: dict[str, Tensor], job: "Job") -> None:
    """Give every entry this process's stage holds whose value here is stale (a previous run's, see the module
    docstring) the current value ``kept`` by another process before the split (a collective call of every process,
    after the split). Each entry comes from the lowest global rank that kept it.

    Raises:
        RuntimeError: if an entry a stage holds is current on no process (its latest value is lost), naming it.
        PipelineFailure: if another process failed meanwhile.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    record = module.__dict__.get(_RECORD)
    stale = sorted(held_names(module) - record) if isinstance(record, frozenset) else []
    every = waiting.all_gather_object(job, (stale, sorted(kept)))
    sources = _sources(every)
    rank = dist.get_rank()
    for source in sorted({source for source, _ in sources.values()}):
        wanted = sorted(name for name, (src, _) in sources.items() if src == source)
        sent = {name: kept[name].cpu() for name in wanted} if rank == source else None
        received = waiting.broadcast_object(job, sent, source)
        mine = {name for name, (_, receivers) in sources.items() if rank in receivers}
        _load(module, {name: value for name, value in received.items() if name in mine})


def _sources(every: list[tuple[list[str], list[str]]]) -> dict[str, tuple[int, set[int]]]:
    """Each stale entry's source rank and the ranks that need it, from every process's ``(stale, kept)`` names."""
    needed: dict[str, set[int]] = {}
    for rank, (stale, _) in enumerate(every):
        for name in stale:
            needed.setdefault(name, set()).add(rank)
    sources = {}
    kept = [set(names) for _, names in every]
    for name, receivers in needed.items():
        source = next((rank for rank, names in enumerate(kept) if name in names), None)
        if source is None:
            raise RuntimeError(
                f"{name}'s latest value is on no process: the last run's stages that held it are gone. Load it from a"
                " checkpoint (ckpt_path=...), or keep the split of the run that trained it."
            )
        sources[name] = (source, receivers)
    return sources


def _load(module: nn.Module, values: dict[str, Any]) -> None:
    state = module_values(module)
    with torch.no_grad():
        for name, value in values.items():
            state[name].copy_(value)
