"""PipelineModelSummary: Lightning's model summary for the whole pipelined model, and how it is split.

Under ``GPipeStrategy`` every stage process holds only its own backbone layers (and the stage that ends the
backbone, the last one or stage 0 in ZB-V's V, the modules after the backbone), so Lightning's ``ModelSummary``
would print one stage's part as if it were the model. :class:`PipelineModelSummary` gathers every stage's modules
and parameters at fit start (one collective call all stages join) and prints, on global rank 0, the whole model's
layer table and totals followed by the split: each stage's backbone layers and parameters. ``GPipeStrategy`` puts it
in place of Lightning's default summary with :func:`replace_model_summary`.
"""

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import (
    get_formatted_model_size,
    get_human_readable_count,
)
from torch import Tensor, nn

from lightning_gpipe._torch import children
from lightning_gpipe.faults import Job
from lightning_gpipe.lightning._lightning import summary_kwargs, summary_max_depth

_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")
"""Lightning's model summary logger, so that whatever silences Lightning's summary silences this one too."""

_PRECISION_BITS = {"64": 64, "32": 32, "16": 16, "bf16": 16, "16-true": 16, "bf16-true": 16, "32-true": 32,
                   "64-true": 64}  # fmt: skip
"""Bits per parameter for the size estimate, as Lightning's summary counts them (32 for mixed precision)."""


@dataclass(frozen=True)
class StageSummary:
    """One stage's share of the model.

    Attributes:
        stage: pipeline rank (0 is the first stage).
        layers: names of the stage's backbone layers, in order (their names in the ``nn.Sequential``).
        parameters: parameter elements the stage holds, each parameter once however many names lead to it: its
            backbone layers, and on the stage that ends the backbone also the modules after it (heads, losses with
            weights). A parameter tied across stages counts on every stage that holds a copy of it.
        trainable_parameters: those of ``parameters`` that require gradients.
    """

    stage: int
    layers: tuple[str, ...]
    parameters: int
    trainable_parameters: int


@dataclass(frozen=True)
class _Row:
    """One line of the layer table, as one stage sees it."""

    name: str
    type: str
    parameters: int
    training: bool
    copies: int = 0  # of ``parameters``, the elements of tied copies counted on another stage


@dataclass(frozen=True)
class _Local:
    """What one stage contributes to the summary (picklable, sent to every rank)."""

    stage: int
    backbone: str
    layers: tuple[str, ...]
    rows: tuple[_Row, ...]
    parameters: dict[str, tuple[int, bool]]  # name -> (elements, requires_grad)
    modes: dict[str, bool]  # module name -> training, every module but the root
    holds_head: bool  # whether the stage ends the backbone and holds the modules after it
    copies: frozenset[str]  # the names of tied copies counted on another stage


class _Pipeline(NamedTuple):
    """The running strategy's pipeline as this module needs it."""

    stage: int
    partition: nn.Module
    job: Job
    holds_head: bool
    copies: list[Tensor]


def _pipeline_of(trainer: "pl.Trainer") -> _Pipeline | None:
    """This process's stage while ``GPipeStrategy`` has split the model; ``None`` under any other strategy.

    The only function here that reads the strategy's attributes. It recognises the strategy by them rather
    than by class, so that this module does not import the strategy (which swaps in the summary).
    """
    strategy: Any = trainer.strategy  # read by its attributes (GPipeStrategy's), not by its class
    run: Any = getattr(strategy, "run", None)
    partition = getattr(run, "partition", None)
    if not isinstance(partition, nn.Module):
        return None
    return _Pipeline(strategy.stage_index, partition, strategy.job, run.pipeline.is_last, run.ties.uncounted())


@contextmanager
def _collective(job: Job) -> Iterator[None]:
    """Name the failed stage (on ``job``'s failure board) if another stage dies during the gather."""
    with job.board.as_pipeline_failure():
        yield


class PipelineModelSummary(ModelSummary):
    """Lightning's ``ModelSummary`` for a pipelined model: the whole model's layers and totals, and the split.

    Under ``GPipeStrategy``, at fit start every stage sends its modules' types, parameter counts and
    training modes to every other (``torch.distributed.all_gather_object`` on the default process group,
    a collective call all stages join); global rank 0 then prints

    - the layer table of the whole model up to ``max_depth``, as Lightning prints it (name, type,
      parameters, mode; no FLOPs or input and output sizes, which would need a forward pass through the
      pipeline), the backbone shown as one ``Sequential`` holding the parameters of all stages;
    - the whole model's trainable, non-trainable and total parameters, its estimated size and the number
      of modules in train and eval mode;
    - one row per stage: its backbone layers (by name: ``0-4``, or ``stem .. reduction1`` for named
      layers), how many they are, the parameters the stage holds and their share of the model.

    Each parameter is counted once, a parameter tied across stages (an embedding and an output head sharing one
    weight) included, so the totals equal those of Lightning's summary of the same module without the strategy;
    a stage's row counts every parameter the stage holds, its copies of tied ones too. Every rank keeps the result
    (see Attributes).

    Under any other strategy it is Lightning's ``ModelSummary``. ``GPipeStrategy`` swaps Lightning's
    default summary for this one (see :func:`replace_model_summary`); to change the depth, pass
    ``Trainer(callbacks=[ModelSummary(max_depth=2)])`` as usual.

    Args:
        max_depth: the maximum depth of layer nesting in the layer table (default 1); 0 turns the summary
            off (and skips the collective call), -1 shows every layer.
        **summarize_kwargs: passed on to ``ModelSummary.summarize`` under other strategies.

    Raises:
        ValueError: if ``max_depth`` is not an integer >= -1.

    Attributes:
        stages: one :class:`StageSummary` per stage after fit start under ``GPipeStrategy``; empty otherwise.
        total_parameters: the whole model's parameter elements after fit start under ``GPipeStrategy``; ``None``
            otherwise.
        trainable_parameters: those of ``total_parameters`` that require gradients; ``None`` until then.
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(
                f"PipelineModelSummary(max_depth={max_depth!r}): choose -1 (every layer), 0 (off) or a depth >= 1."
            )
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self.stages: list[StageSummary] = []
        self.total_parameters: int | None = None
        self.trainable_parameters: int | None = None

    @property
    def max_depth(self) -> int:
        """The maximum depth of layer nesting in the layer table (0: no summary, -1: every layer)."""
        return summary_max_depth(self)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Gather every stage's part and print the whole model's summary on global rank 0 (a collective call).

        Under a strategy other than ``GPipeStrategy`` this is Lightning's ``ModelSummary.on_fit_start``.
        """
        pipeline = _pipeline_of(trainer)
        if pipeline is None:
            super().on_fit_start(trainer, pl_module)
            return
        if not self.max_depth:
            return
        local = _local_part(
            pl_module, pipeline.partition, pipeline.stage, self.max_depth, pipeline.holds_head, pipeline.copies
        )
        parts: list[Any] = [None] * dist.get_world_size()
        with _collective(pipeline.job):
            dist.all_gather_object(parts, local)
        table, self.stages = _merge(parts)
        self.total_parameters, self.trainable_parameters = table.total, table.trainable
        if trainer.is_global_zero:
            _log.info("\n" + _format(table, self.stages, _PRECISION_BITS.get(str(trainer.precision), 32)))


def replace_model_summary(trainer: "pl.Trainer") -> ModelSummary | None:
    """Swap Lightning's ``ModelSummary`` or ``RichModelSummary`` in ``trainer.callbacks`` for a
    :class:`PipelineModelSummary` with the same ``max_depth``, at the same place in the list.

    Only those two exact classes are replaced: a user's own subclass, or a :class:`PipelineModelSummary`
    already there, is kept as it is. Without a summary callback (``enable_model_summary=False``) nothing is
    added. Call it before fit starts (``GPipeStrategy.setup`` does).

    Args:
        trainer: the trainer whose callbacks to change.

    Returns:
        The summary callback now in ``trainer.callbacks`` (the new one, or the one kept), or ``None`` when
        there is none.
    """
    for index, callback in enumerate(trainer.callbacks):  # type: ignore[attr-defined]  # set by Lightning, undeclared
        if type(callback) in (ModelSummary, RichModelSummary):
            replacement = PipelineModelSummary(summary_max_depth(callback), **summary_kwargs(callback))
            trainer.callbacks[index] = replacement  # type: ignore[attr-defined]
            return replacement
        if isinstance(callback, ModelSummary):
            return callback
    return None


@dataclass(frozen=True)
class _Table:
    """The whole model's layer table and totals."""

    rows: list[_Row]
    leftover: int  # parameters of no listed module (held by the LightningModule itself)
    total: int
    trainable: int
    modes: dict[str, bool]
    num_stages: int
    head_stage: int  # the stage ending the backbone, which holds the modules after it


def _local_part(
    module: nn.Module,
    partition: nn.Module,
    stage: int,
    max_depth: int,
    holds_head: bool,
    copies: Iterable[Tensor] = (),
) -> _Local:
    """This stage's layer rows (up to ``max_depth``), parameters and module modes.

    Args:
        module: this stage's LightningModule.
        partition: the stage's backbone layers.
        stage: the stage's pipeline rank.
        max_depth: the summary's depth.
        holds_head: whether the stage ends the backbone (and holds the modules after it).
        copies: the stage's copies of tied parameters that another stage counts
            (:meth:`~lightning_gpipe.engine.TiedParameters.uncounted`).
    """
    everywhere = list(module.named_modules(remove_duplicate=False))  # the backbone may be reached by other paths too
    backbone = min((name for name, sub in everywhere if sub is partition), key=lambda name: name.count("."))
    copied = {id(p) for p in copies}

    def row(name: str, sub: nn.Module) -> _Row:
        elements = sum(_numel(p) for p in sub.parameters())
        tied = sum(_numel(p) for p in sub.parameters() if id(p) in copied)
        return _Row(name, type(sub).__name__, elements, sub.training, tied)

    return _Local(
        stage=stage,
        backbone=backbone,
        layers=tuple(children(partition)),  # every position, a layer used at two included
        rows=tuple(row(name, sub) for name, sub in _named_layers(module, max_depth)),
        parameters={name: (_numel(p), p.requires_grad) for name, p in module.named_parameters()},
        modes={name: sub.training for name, sub in list(module.named_modules())[1:]},
        holds_head=holds_head,
        copies=frozenset(name for name, p in module.named_parameters() if id(p) in copied),
    )


def _named_layers(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    """The modules Lightning's summary lists for ``max_depth``: the children for 1, else all up to that depth."""
    if max_depth == 1:
        return list(module.named_children())
    layers = list(module.named_modules())[1:]
    return layers if max_depth == -1 else [(name, sub) for name, sub in layers if name.count(".") < max_depth]


def _numel(parameter: nn.Parameter) -> int:
    """Elements of ``parameter``; 0 for a lazy one whose shape is not known yet (as Lightning counts), and for one on
    the meta device, which the stage does not hold."""
    lazy = isinstance(parameter, nn.parameter.UninitializedParameter)
    return 0 if lazy or parameter.is_meta else parameter.numel()


def _merge(parts: list[_Local]) -> tuple[_Table, list[StageSummary]]:
    """The whole model's layer table and the stages' summaries, from every stage's part.

    A row present on several stages (the backbone itself, a module that lives on the stage ending the backbone only
    and is a placeholder elsewhere) adds up their parameters, less the tied copies another stage counts where
    several stages hold some of them, and takes the type and mode of the stage ending the backbone. Rows keep the
    model's order: top-level modules as declared, the backbone's layers stage by stage. The totals count a tied
    parameter once, as Lightning's summary of the module without the strategy does. With several data-parallel
    replicas, the first part of each stage is used.
    """
    by_stage: dict[int, _Local] = {}
    for part in parts:
        by_stage.setdefault(part.stage, part)
    stages = [by_stage[k] for k in sorted(by_stage)]
    ordered = sorted(stages, key=lambda part: part.holds_head)  # the stage ending the backbone last: its rows win
    head = ordered[-1]
    top = {row.name: i for i, row in enumerate(r for r in head.rows if "." not in r.name)}
    merged: dict[str, tuple[tuple[int, int, int], _Row]] = {}
    for part in ordered:
        for position, row in enumerate(part.rows):
            inside = row.name.startswith(head.backbone + ".")
            key = (top.get(row.name.split(".")[0], len(top)), part.stage if inside else -1, position)
            if row.name in merged:
                row = _merge_row(merged[row.name][1], row)
            merged[row.name] = (key, row)
    rows = [row for _, row in sorted(merged.values(), key=lambda item: item[0])]
    sequential = f"Sequential ({_stages(len(stages))})"
    rows = [
        _Row(row.name, sequential, row.parameters, row.training) if row.name == head.backbone else row for row in rows
    ]
    parameters: dict[str, tuple[int, bool]] = {}
    modes: dict[str, bool] = {}
    for part in ordered:
        parameters.update((name, counts) for name, counts in part.parameters.items() if name not in part.copies)
        modes.update(part.modes)
    total = sum(n for n, _ in parameters.values())
    trainable = sum(n for n, requires_grad in parameters.values() if requires_grad)
    leftover = max(total - sum(row.parameters for row in rows), 0)
    table = _Table(rows, leftover, total, trainable, modes, len(stages), head.stage)
    summaries = [
        StageSummary(
            stage=part.stage,
            layers=part.layers,
            parameters=sum(n for n, _ in part.parameters.values()),
            trainable_parameters=sum(n for n, requires_grad in part.parameters.values() if requires_grad),
        )
        for part in stages
    ]
    return table, summaries


def _merge_row(seen: _Row, row: _Row) -> _Row:
    """One row of two stages' (``seen``: of the earlier ones): their parameters together, a tied copy once where
    both hold parameters of the row; the type and mode of ``row``."""
    if seen.parameters and row.parameters:
        parameters, copies = seen.parameters + row.parameters - row.copies - seen.copies, 0
    else:
        parameters, copies = seen.parameters + row.parameters, seen.copies + row.copies
    return _Row(row.name, row.type, parameters, row.training, copies)


def _stages(count: int, noun: str = "stage") -> str:
    """``"2 stages"``, ``"1 stage"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _layer_range(layers: tuple[str, ...]) -> str:
    """``0-4`` for numbered layers (``0-1, 6-7`` for a stage of several model chunks), ``stem .. reduction1`` for
    named ones, the name alone for one layer."""
    if not layers:
        return "-"
    if not all(name.isdigit() for name in layers):
        return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]}"
    runs: list[list[int]] = []
    for position in map(int, layers):
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _columns(*columns: tuple[str, list[str]]) -> str:
    """A table of ``(header, cells)`` columns in the layout of Lightning's summary."""
    widths = [max([len(header), *map(len, cells)]) for header, cells in columns]
    line = "-" * (sum(widths) + 3 * (len(columns) + 1))

    def format_row(cells: list[str]) -> str:
        return " | ".join(f"{cell:<{width}}" for cell, width in zip(cells, widths))

    body = [format_row([cells[i] for _, cells in columns]) for i in range(len(columns[0][1]))]
    return "\n".join([format_row([header for header, _ in columns]), line, *body, line])


def _format(table: _Table, stages: list[StageSummary], precision_bits: int) -> str:
    """The printed summary: the layer table, the totals, then the split into stages."""
    rows = list(table.rows)
    if table.leftover:
        rows.append(_Row("other params", "n/a", table.leftover, True))
    layer_table = _columns(
        (" ", [str(i) if row.name != "other params" else " " for i, row in enumerate(rows)]),
        ("Name", [row.name for row in rows]),
        ("Type", [row.type for row in rows]),
        ("Params", [get_human_readable_count(row.parameters) for row in rows]),
        ("Mode", ["n/a" if row.name == "other params" else "train" if row.training else "eval" for row in rows]),
    )
    train = sum(table.modes.values())
    totals = [
        (get_human_readable_count(table.trainable), "Trainable params"),
        (get_human_readable_count(table.total - table.trainable), "Non-trainable params"),
        (get_human_readable_count(table.total), "Total params"),
        (get_formatted_model_size(table.total * precision_bits / 8 * 1e-6), "Total estimated model params size (MB)"),
        (str(train), "Modules in train mode"),
        (str(len(table.modes) - train), "Modules in eval mode"),
    ]
    stage_table = _columns(
        ("Stage", [str(s.stage) for s in stages]),
        ("Backbone layers", [_layer_range(s.layers) for s in stages]),
        ("Layers", [str(len(s.layers)) for s in stages]),
        ("Params", [get_human_readable_count(s.parameters) for s in stages]),
        ("Share", [f"{s.parameters / table.total:.0%}" if table.total else "-" for s in stages]),
    )
    return "\n".join(
        [
            layer_table,
            *(f"{value:<10}{label}" for value, label in totals),
            f"Split into {_stages(table.num_stages, 'pipeline stage')} (the modules after the backbone are on"
            f" {'its last stage' if table.head_stage == table.num_stages - 1 else f'stage {table.head_stage}'}):",
            stage_table,
        ]
    )
