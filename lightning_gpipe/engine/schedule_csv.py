"""Schedules other tools write: torch.distributed.pipelining's action format (the CSV torchtitan's
``pipeline_parallel_schedule_csv`` reads) read into our plans, and our plans written in it.

The format (torch's ``_PipelineScheduleRuntime._load_csv`` and ``_dump_csv``): one row per pipeline rank, one cell per
action, ``{stage}{type}{micro-batch}`` as torch's ``_Action`` prints it (``2F0``), an empty cell for an idle step. The
stage is the *virtual* stage; its rank is the row that runs it, which must be our placement, looped (virtual stage s on
rank ``s mod K``) or in a V (:func:`~lightning_gpipe.engine.actions.virtual_stage`). The compute types map onto our
:class:`~lightning_gpipe.engine.actions.Kind`: ``F`` forward, ``B`` a whole backward, ``I`` the input gradient (our
``backward`` under the B/W split) and ``W`` its weight gradient; ``(..;..)OVERLAP_F_B`` runs its sub-actions one after
the other. The communication types of a "compute_comms" schedule (``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``) and
FSDP's and the gradient reduction's (``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``) are checked to name a stage of their
rank and a micro-batch of the step, then dropped: our runtime places every transfer itself (each activation sent after
its forward, each gradient's receive posted as soon as the order of the stage's backwards allows, which
:func:`~lightning_gpipe.engine.schedule.check` proves cannot deadlock), and the sharding and the data-parallel reduction
are torch's engines', run by the strategy. Re-materialization is ours too: a recompute goes right before each
checkpointed backward. Where every stage runs all its forwards before any backward (fill-drain) and the placement is
looped, the loss runs once on the whole mini-batch between the two phases, as ``"gpipe"``; otherwise once per
micro-batch after its last forward, as ``"1f1b"``.

What our runtime cannot run is a ``ValueError`` naming the row and column: an unknown action, a ``W`` without its ``I``
before it (or an ``I`` without its ``W``), a micro-batch missing or run twice, a virtual stage's forwards out of
micro-batch order (the first takes its micro-batches in order) or its ``W`` in another order than its ``I``. The
first virtual stage sends no input gradient, so its ``I``/``W`` pairs run as one backward where the ``I`` is.
"""

import csv
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

from lightning_gpipe.engine.actions import Action, Kind, Plan, splits_backward, stage_of_virtual, virtual_stage
from lightning_gpipe.engine.rematerialization import checkpointed
from lightning_gpipe.engine.schedule import V_SHAPED, ScheduleError, check, plans

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE = ("F", "B", "I", "W")
_FORMAT = "[stage][F|B|I|W][micro-batch], e.g. 2F0, as torch.distributed.pipelining's _Action prints it"


def is_schedule_file(schedule: object) -> bool:
    """Whether ``schedule`` (``GPipeStrategy(schedule=...)``) names a CSV file of torch's format, not a schedule of
    :data:`~lightning_gpipe.engine.schedule.SCHEDULES`."""
    return isinstance(schedule, str) and schedule.lower().endswith(".csv")


class _Cell(NamedTuple):
    """One action of the CSV: where it is (0-based row = rank, column) and what it says."""

    row: int
    column: int
    stage: int
    kind: str
    micro_batch: int | None

    def __str__(self) -> str:
        index = "" if self.micro_batch is None else str(self.micro_batch)
        return f"row {self.row + 1} (rank {self.row}), column {self.column + 1} ({self.stage}{self.kind}{index})"


@dataclass(frozen=True)
class ScheduleTable:
    """A schedule read from torch's CSV format (:func:`read_schedule`): each rank's compute actions, checked to be
    runnable by our runtime for its own K, M and virtual stages; :meth:`plans` makes the plans.

    Attributes:
        source: the file's path, or ``"<text>"``.
        rows: each rank's compute actions (``F``, ``B``, ``I``, ``W``), in order.
        v_shape: whether the virtual stages are placed in a V (else looped).
    """

    source: str
    rows: tuple[tuple[_Cell, ...], ...]
    v_shape: bool

    @property
    def num_stages(self) -> int:
        """K, the ranks (rows)."""
        return len(self.rows)

    @cached_property
    def virtual_stages(self) -> int:
        """v, the model chunks per rank."""
        return (1 + max(cell.stage for row in self.rows for cell in row)) // self.num_stages

    @cached_property
    def micro_batches(self) -> int:
        """M, the micro-batches of a step."""
        return 1 + max(cell.micro_batch or 0 for row in self.rows for cell in row)

    @cached_property
    def splits(self) -> bool:
        """Whether a virtual stage after the first splits its backwards into I and W (``defer_weight_grad``)."""
        return any(cell.kind == "I" and cell.stage > 0 for row in self.rows for cell in row)

    @cached_property
    def fill_drain(self) -> bool:
        """Whether every rank runs all its forwards before any backward, looped: the loss then runs on the whole
        mini-batch between the two phases."""
        return not self.v_shape and all(_forwards_first(row) for row in self.rows)

    def fit(self, num_stages: int, micro_batches: int, virtual_stages: int) -> None:
        """Check that the table is written for K = ``num_stages`` ranks, M = ``micro_batches`` and v =
        ``virtual_stages``.

        Raises:
            ValueError: naming the table's K, M and v, for another pipeline.
        """
        found = (self.num_stages, self.micro_batches, self.virtual_stages)
        for what, number, written in zip(
            ("ranks (K)", "micro-batches (M)", "virtual stages per rank (v)"),
            (num_stages, micro_batches, virtual_stages),
            found,
        ):
            if number != written:
                raise ValueError(
                    f"schedule {self.source} is written for {written} {what}, not {number}: run it on {found[0]}"
                    f" stages, with {found[1]} micro-batches and {found[2]} virtual stages per stage, or write it for"
                    " the pipeline you run."
                )

    def plans(
        self, checkpoint: str, defer_weight_grad: bool | None = None, micro_batches: int | None = None
    ) -> list[Plan]:
        """Every rank's plan, unchecked (see :func:`plans_from_csv`).

        Args:
            checkpoint: the re-materialization mode: a recompute before each checkpointed backward.
            defer_weight_grad: the B/W split; ``None`` (default): :attr:`splits`.
            micro_batches: M of the step, at most :attr:`micro_batches` (default): with fewer (a batch with fewer
                rows), the actions of the first ``micro_batches`` micro-batches, in the table's order.

        Raises:
            ValueError: with ``defer_weight_grad=False`` for a table that splits its backwards.
        """
        split = self.splits if defer_weight_grad is None else defer_weight_grad
        if self.splits and not split:
            first = next(cell for row in self.rows for cell in row if cell.kind == "I" and cell.stage > 0)
            raise ValueError(
                f"schedule {self.source}: {first} splits a backward into I and W, which needs the B/W split; leave"
                " defer_weight_grad unset (or True)."
            )
        m = self.micro_batches if micro_batches is None else micro_batches
        build = _fill_drain_plan if self.fill_drain else _per_micro_batch_plan
        return [
            build(self, k, [c for c in row if (c.micro_batch or 0) < m], checkpoint, split, m)
            for k, row in enumerate(self.rows)
        ]


def read_schedule(source: str | os.PathLike) -> ScheduleTable:
    """Read a schedule in torch's CSV format (see the module docstring): ``source`` is a path, or the CSV's text
    itself (a string with a line break or a comma).

    Raises:
        FileNotFoundError: for a path that is not a file.
        ValueError: naming the row and column, for what our runtime cannot run (see the module docstring), or a
            placement of the virtual stages that is neither looped nor a V.
    """
    text, name = _text(source)
    rows: list[list[_Cell]] = []
    communication: list[_Cell] = []
    for r, row in enumerate(csv.reader(io.StringIO(text))):
        rows.append([])
        for column, entry in enumerate(row):
            for cell in _parse(name, r, column, entry):
                (rows[r] if cell.kind in _COMPUTE else communication).append(cell)
    while rows and not rows[-1]:
        rows.pop()
    if not rows or not any(rows):
        raise ValueError(f"schedule {name}: no action in it; write one row of actions per pipeline rank ({_FORMAT}).")
    v_shape = _placement(name, rows)
    table = ScheduleTable(name, tuple(tuple(row) for row in rows), v_shape)
    _check_actions(table)
    _check_communication(table, communication)
    return table


def _text(source: str | os.PathLike) -> tuple[str, str]:
    """The CSV's text and how messages name it."""
    if isinstance(source, str) and ("\n" in source or "," in source):
        return source, "<text>"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(
            f"schedule {os.fspath(source)!r}: no such file; give the path of a CSV schedule in torch.distributed."
            "pipelining's format (one row of actions per pipeline rank), e.g. one written by"
            " lightning_gpipe.export_schedule."
        )
    return path.read_text(), os.fspath(source)


def _parse(name: str, row: int, column: int, entry: str) -> list[_Cell]:
    """The actions of one cell: none for an empty one, the sub-actions of an ``OVERLAP_F_B``."""
    entry = entry.strip()
    if not entry:
        return []
    overlap = _OVERLAP.fullmatch(entry)
    parts = [p.strip() for p in overlap.group(1).split(";") if p.strip()] if overlap else [entry]
    cells = []
    for part in parts:
        match = _ACTION.fullmatch(part)
        if match is None or (overlap and match.group(2) not in _COMPUTE):
            raise ValueError(
                f"schedule {name}: row {row + 1} (rank {row}), column {column + 1}: {entry!r} is not an action of"
                f" torch.distributed.pipelining's format ({_FORMAT})."
            )
        stage, kind, index = match.groups()
        cell = _Cell(row, column, int(stage), kind, int(index) if index else None)
        if kind in _COMPUTE and cell.micro_batch is None:
            raise ValueError(f"schedule {name}: {cell}: a {kind} action needs its micro-batch, e.g. {stage}{kind}0.")
        cells.append(cell)
    return cells


def _placement(name: str, rows: list[list[_Cell]]) -> bool:
    """Whether the rows place the virtual stages in a V (else looped); each virtual stage on one rank.

    Raises:
        ValueError: for a virtual stage on two ranks, none, a number of them that is not a multiple of the ranks,
            or a placement that is neither.
    """
    num_stages, where = len(rows), dict[int, _Cell]()
    for row in rows:
        for cell in row:
            if where.setdefault(cell.stage, cell).row != cell.row:
                raise ValueError(
                    f"schedule {name}: {cell}: stage {cell.stage} runs on rank {where[cell.stage].row} too."
                )
    num_virtual = 1 + max(where)
    missing = sorted(set(range(num_virtual)) - set(where))
    if missing:
        raise ValueError(f"schedule {name}: virtual stages {missing} run no action; number them 0, 1, ... K x v - 1.")
    if num_virtual % num_stages:
        raise ValueError(
            f"schedule {name}: {num_virtual} virtual stages on {num_stages} ranks: give each rank as many (v per rank)."
        )
    for v_shape in (False, True):
        if all(stage_of_virtual(s, num_stages, v_shape)[0] == cell.row for s, cell in where.items()):
            return v_shape
    wrong = next(c for s, c in sorted(where.items()) if stage_of_virtual(s, num_stages)[0] != c.row)
    raise ValueError(
        f"schedule {name}: {wrong}: our runtime places the virtual stages looped (stage s on rank s mod"
        f" {num_stages}) or in a V (stages k and 2K - 1 - k on rank k); write the schedule with one of them."
    )


def _check_actions(table: ScheduleTable) -> None:
    """Every virtual stage runs each micro-batch's forward once, in micro-batch order, and its backward once (B, or
    I then W, the W in the order of the I).

    Raises:
        ValueError: naming the row and column of the first action that breaks this.
    """
    name, m = table.source, table.micro_batches
    for row in table.rows:
        for stage in sorted({cell.stage for cell in row}):
            cells = [cell for cell in row if cell.stage == stage]
            forwards = [cell for cell in cells if cell.kind == "F"]
            for i, cell in enumerate(forwards):
                if cell.micro_batch != i:
                    raise ValueError(
                        f"schedule {name}: {cell}: stage {stage}'s forwards must run in micro-batch order, 0 to {m - 1}"
                        f" (the first stage takes its micro-batches in order), but this is its forward number {i}."
                    )
            if len(forwards) < m:
                raise ValueError(
                    f"schedule {name}: stage {stage} (rank {row[0].row}) runs no forward of micro-batch"
                    f" {len(forwards)}; every stage runs all {m} micro-batches."
                )
            _check_backwards(name, stage, cells, m)


def _check_backwards(name: str, stage: int, cells: list[_Cell], m: int) -> None:
    """One virtual stage's backwards: each micro-batch's once, after its forward; each W after its I, in their order."""
    forwarded: set[int | None] = set()
    backwards: dict[int | None, _Cell] = {}
    inputs: list[int | None] = []  # micro-batches whose I ran and whose W has not
    for cell in cells:
        i = cell.micro_batch
        if cell.kind == "F":
            forwarded.add(i)
        elif cell.kind in ("B", "I"):
            if i not in forwarded or i in backwards:
                raise ValueError(
                    f"schedule {name}: {cell}: "
                    + ("a second backward of" if i in backwards else "before the forward of")
                    + f" micro-batch {i}."
                )
            backwards[i] = cell
            inputs += [i] * (cell.kind == "I")
        elif not inputs or inputs[0] != i:
            why = f"the W of micro-batch {inputs[0]} comes first" if i in inputs else f"no {stage}I{i} before it"
            raise ValueError(
                f"schedule {name}: {cell}: {why}; each W follows its I, in the order of the I (our runtime queues"
                " them)."
            )
        else:
            inputs.pop(0)
    if inputs:
        raise ValueError(f"schedule {name}: {backwards[inputs[0]]}: an I without its W after it.")
    missing = sorted(set(range(m)) - set(backwards))
    if missing:
        raise ValueError(f"schedule {name}: stage {stage} runs no backward (B or I) of micro-batch {missing[0]}.")


def _check_communication(table: ScheduleTable, communication: list[_Cell]) -> None:
    """The communication actions of a "compute_comms" schedule name a stage of their rank and a micro-batch of the step
    (our runtime places its own transfers, so they are dropped after this).

    Raises:
        ValueError: naming the row and column of one that does not.
    """
    for cell in communication:
        held = {each.stage for each in table.rows[cell.row]} if cell.row < table.num_stages else set()
        if cell.stage not in held or (cell.micro_batch or 0) >= table.micro_batches:
            raise ValueError(
                f"schedule {table.source}: {cell}: names a stage its rank does not run or a micro-batch the step does"
                f" not have (stages {sorted(held)}, micro-batches 0 to {table.micro_batches - 1})."
            )


def _forwards_first(row: Sequence[_Cell]) -> bool:
    kinds = [cell.kind for cell in row]
    backward = [n for n, kind in enumerate(kinds) if kind != "F"]
    return not backward or "F" not in kinds[backward[0] :]


def _backward(cell: _Cell, c: int, checkpoint: str, split: bool, m: int) -> list[Action]:
    """A ``B``/``I`` cell's actions on model chunk ``c``: its recompute (if checkpointed), the backward, and for a ``B``
    under the split its W at once; a ``W`` cell's W (none on the first virtual stage, which does not split)."""
    i, splits = cell.micro_batch, splits_backward(cell.stage, split)
    if cell.kind == "W":
        return [Action(Kind.WEIGHT, i, c)] * splits
    recompute = [Action(Kind.RECOMPUTE, i, c)] * checkpointed(checkpoint, i or 0, m)
    return recompute + [Action(Kind.BACKWARD, i, c)] + [Action(Kind.WEIGHT, i, c)] * (splits and cell.kind == "B")


def _fill_drain_plan(table: ScheduleTable, k: int, row: list[_Cell], checkpoint: str, split: bool, m: int) -> Plan:
    """Rank ``k``'s plan with the loss on the whole mini-batch (``"gpipe"``'s shape): the forwards, each sent on; then
    the loss, every gradient's receive in the order of the backwards, and the backwards."""
    last, num_stages = table.num_stages * table.virtual_stages - 1, table.num_stages
    fill: list[Action] = []
    drain = [Action(Kind.LOSS)] * (stage_of_virtual(last, num_stages)[0] == k)
    backwards = []
    for cell in row:
        c = stage_of_virtual(cell.stage, num_stages)[1]
        if cell.kind == "F":
            fill += [Action(Kind.FORWARD, cell.micro_batch, c)] + [Action(Kind.SEND, cell.micro_batch, c)] * (
                cell.stage != last
            )
            continue
        if cell.kind != "W":
            drain.append(Action(Kind.EXPECT, cell.micro_batch, c))
        backwards += _backward(cell, c, checkpoint, split, m)
    return Plan(tuple(fill + drain + backwards + [Action(Kind.FLUSH)]), backward_from=len(fill))


def _per_micro_batch_plan(table: ScheduleTable, k: int, row: list[_Cell], checkpoint: str, split: bool, m: int) -> Plan:
    """Rank ``k``'s plan with a loss per micro-batch (``"1f1b"``'s shape): each forward followed by its loss on the
    last virtual stage, else sent on; each gradient's receive posted once its forward is sent and the receives of the
    model chunk's earlier backwards are."""
    last, num_stages, v_shape = table.num_stages * table.virtual_stages - 1, table.num_stages, table.v_shape
    order: dict[int, list[int | None]] = {}  # each model chunk's backwards, in order
    for cell in row:
        if cell.kind in ("B", "I"):
            order.setdefault(stage_of_virtual(cell.stage, num_stages, v_shape)[1], []).append(cell.micro_batch)
    sent: set[tuple[int | None, int]] = set()
    posted = dict.fromkeys(order, 0)
    actions: list[Action] = []
    for cell in row:
        i, c = cell.micro_batch, stage_of_virtual(cell.stage, num_stages, v_shape)[1]
        if cell.kind != "F":
            actions += _backward(cell, c, checkpoint, split, m)
        elif cell.stage == last:
            actions += [Action(Kind.FORWARD, i, c), Action(Kind.LOSS, i, c)]
        else:
            actions += [Action(Kind.FORWARD, i, c), Action(Kind.SEND, i, c)]
            sent.add((i, c))
            while posted[c] < len(order[c]) and (order[c][posted[c]], c) in sent:
                actions.append(Action(Kind.EXPECT, order[c][posted[c]], c))
                posted[c] += 1
    actions.append(Action(Kind.FLUSH))
    return Plan(tuple(actions), backward_from=len(actions), loss_per_micro_batch=True, v_shape=v_shape)


def plans_from_csv(
    source: str | os.PathLike,
    num_stages: int,
    micro_batches: int,
    checkpoint: str = "except_last",
    virtual_stages: int | None = None,
    defer_weight_grad: bool | None = None,
) -> tuple[Plan, ...]:
    """Every rank's plan of a schedule in torch.distributed.pipelining's CSV format (the module docstring says how it
    maps), checked by :func:`~lightning_gpipe.engine.schedule.check`.

    Args:
        source: the CSV file's path, or its text.
        num_stages: K, the pipeline's ranks: the CSV's rows.
        micro_batches: M: the CSV's micro-batches.
        checkpoint: the re-materialization mode (default ``"except_last"``): a recompute before each checkpointed
            backward.
        virtual_stages: v, model chunks per rank; ``None`` (default): the CSV's.
        defer_weight_grad: the B/W split; ``None`` (default): where the CSV splits a backward into I and W.

    Raises:
        FileNotFoundError: for a path that is not a file.
        ValueError: naming the row and column, for an action our runtime cannot run; naming the fix, for a CSV of
            other K, M or v than asked for; :class:`~lightning_gpipe.engine.schedule.ScheduleError` (a ``ValueError``)
            for plans whose stages would wait for each other.
    """
    table = read_schedule(source)
    table.fit(num_stages, micro_batches, table.virtual_stages if virtual_stages is None else virtual_stages)
    every = table.plans(checkpoint, defer_weight_grad)
    try:
        check(every)
    except ScheduleError as error:
        raise ScheduleError(f"schedule {table.source}: {error}") from error
    return tuple(every)


def plans_to_csv(stage_plans: Sequence[Plan]) -> str:
    """The plans (one per rank) in torch.distributed.pipelining's CSV format, "compute_only" (what
    ``_PipelineScheduleRuntime._load_csv`` and torchtitan's ``pipeline_parallel_schedule_csv`` read): a row per rank,
    ``{virtual stage}F{i}`` for a forward, ``I`` for a backward whose W the plan runs apart (else ``B``), ``W`` for
    that W. Transfers, losses and recomputes are left out (torch places its own; the loss is in the last stage's F)."""
    output = io.StringIO()
    writer = csv.writer(output, lineterminator="\n")
    num_stages = len(stage_plans)
    for k, plan in enumerate(stage_plans):
        weights = {(a.micro_batch, a.model_chunk) for a in plan.actions if a.kind is Kind.WEIGHT}
        cells = []
        for action in plan.actions:
            kind = {Kind.FORWARD: "F", Kind.WEIGHT: "W"}.get(action.kind)
            if action.kind is Kind.BACKWARD:
                kind = "I" if (action.micro_batch, action.model_chunk) in weights else "B"
            if kind is not None:
                stage = virtual_stage(k, action.model_chunk, num_stages, plan.v_shape)
                cells.append(f"{stage}{kind}{action.micro_batch}")
        writer.writerow(cells)
    return output.getvalue()


def export_schedule(
    schedule: str,
    num_stages: int,
    micro_batches: int,
    virtual_stages: int | None = None,
    checkpoint: str = "except_last",
    defer_weight_grad: bool | None = None,
    path: str | os.PathLike | None = None,
) -> str:
    """One of our schedules as a CSV in torch.distributed.pipelining's format, for torch's
    ``_PipelineScheduleRuntime._load_csv`` or torchtitan's ``--parallelism.pipeline_parallel_schedule_csv``; it runs
    here too, as ``GPipeStrategy(schedule="that.csv")``. ``"zb-1p"`` and ``"zb-v"`` place their W by equal costs.

    Args:
        schedule: a name of :data:`~lightning_gpipe.engine.schedule.SCHEDULES`.
        num_stages: K, the pipeline's ranks (the CSV's rows).
        micro_batches: M.
        virtual_stages: v, model chunks per rank; ``None`` (default): 2 for the V schedules, else 1.
        checkpoint: the re-materialization mode the plans are made for (default ``"except_last"``, the strategy's):
            the CSV leaves recomputes out, but a schedule placed by cost times them.
        defer_weight_grad: the B/W split, as for ``GPipeStrategy``; ``None`` (default): the schedule's default.
        path: where to write the CSV too; ``None`` (default): only returned.

    Returns:
        The CSV's text.

    Raises:
        ValueError: for an unknown schedule, or options it does not take (as ``GPipeStrategy`` would).
    """
    v = (2 if schedule in V_SHAPED else 1) if virtual_stages is None else virtual_stages
    text = plans_to_csv(plans(schedule, num_stages, micro_batches, checkpoint, defer_weight_grad, v))
    if path is not None:
        Path(path).write_text(text)
    return text
