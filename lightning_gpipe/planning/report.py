"""What the planner chose and why: the ranked predictions as a table (printed at fit start) and as a dict."""

from dataclasses import dataclass
from typing import Any

from lightning_gpipe.planning.costs import CostModel, ProfiledCosts
from lightning_gpipe.planning.predict import PlanPrediction

MIB = 2**20
RUNNERS_UP = 5
"""How many runners-up the table and the dict show."""


@dataclass(repr=False)
class PlanReport:
    """Every predicted plan, fastest per row first among those that fit, then those that do not.

    Args:
        predictions: the ranked :class:`~lightning_gpipe.planning.predict.PlanPrediction` list.
        memory_limit: bytes per device the plans had to fit.
        world_size: processes of the job.
        model: the cost model's constants.
        profiled: the layers' costs the predictions came from (to predict again with another
            :class:`~lightning_gpipe.planning.costs.CostModel`, see docs/planning.md, "Calibrating").
        state_factor: the optimizer's state tensors per parameter the predictions assumed.
    """

    predictions: list[PlanPrediction]
    memory_limit: float
    world_size: int
    model: CostModel
    profiled: ProfiledCosts
    state_factor: int

    @property
    def chosen(self) -> PlanPrediction:
        """The plan that runs: the fastest per row that fits."""
        return self.predictions[0]

    @property
    def runners_up(self) -> list[PlanPrediction]:
        """The next :data:`RUNNERS_UP` plans that fit."""
        return [p for p in self.predictions[1:] if p.fits][:RUNNERS_UP]

    @property
    def smallest_fitting_limit(self) -> float:
        """The smallest memory limit (bytes per device) under which some candidate would fit."""
        return min(p.peak_bytes for p in self.predictions) / (1 - self.model.memory_margin)

    def __repr__(self) -> str:
        """The chosen plan and how many fit, in one line (:meth:`table` ranks them; the fields hold every plan)."""
        fits = sum(p.fits for p in self.predictions)
        options = ", ".join(f"{key}={value!r}" for key, value in self.chosen.plan.options().items())
        return (
            f"PlanReport(chosen: {options}; step {self.chosen.step_time:.4g} s predicted; {fits} of"
            f" {len(self.predictions)} plans fit {self.memory_limit / MIB:,.0f} MiB per device on {self.world_size}"
            " processes)"
        )

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data (for a logger or a JSON file): the limit, the world size, how many plans were
        predicted and fit, and the chosen plan and runners-up, each with its options, predicted step time, seconds
        per row, bubble and per-stage memory by part (bytes)."""
        return {
            "memory_limit": self.memory_limit,
            "world_size": self.world_size,
            "candidates": len(self.predictions),
            "feasible": sum(p.fits for p in self.predictions),
            "chosen": _entry(self.chosen),
            "runners_up": [_entry(p) for p in self.runners_up],
        }

    def table(self) -> str:
        """The chosen plan and the runners-up as a text table, one row each, with each stage's predicted peak
        (``vN`` after a schedule: N model chunks per stage; ``off``: activation offload; ``xT`` after the mesh: T
        tensor ranks per stage; ``s`` after it: its stages' state sharded by FSDP2)."""
        head = (
            f"Pipeline plan: {sum(p.fits for p in self.predictions)} of {len(self.predictions)} plans fit"
            f" {self.memory_limit / MIB:,.0f} MiB per device ({self.world_size} processes); fastest per row first"
        )
        columns = f"   {'K x D':<6}{'chunks':>7}  {'checkpoint':<12}{'schedule':<14}{'balance':<16}"
        columns += f"{'step s':>9}{'ms/row':>8}{'bubble':>8}  peak MiB per stage"
        rows = [_row(" *", self.chosen)] + [_row("  ", p) for p in self.runners_up]
        legend = " * chosen; s after K x D: sharded by FSDP2; off: activation offload"
        if self.chosen.plan.tensor_parallel_size > 1:
            legend += "; x T after K x D: T tensor ranks per stage, each peak one process's"
        return "\n".join([head, columns, *rows, legend])


def _row(mark: str, p: PlanPrediction) -> str:
    plan = p.plan
    balance = ",".join(map(str, plan.balance))
    balance = balance if len(balance) <= 15 else balance[:12] + "..."
    peaks = " / ".join(f"{stage.total / MIB:,.0f}" for stage in p.memory)
    schedule = plan.schedule + (f" v{plan.virtual_stages}" if plan.virtual_stages > 1 else "")  # model chunks per stage
    schedule += " off" if plan.offload is not None else ""  # activation offload
    mesh = f"{plan.pipeline_parallel_size}x{plan.data_parallel_size}"
    mesh += f"x{plan.tensor_parallel_size}" if plan.tensor_parallel_size > 1 else ""  # tensor ranks per stage
    mesh += "s" if plan.fully_sharded else ""
    return (
        f"{mark} {mesh:<6}{plan.micro_batches:>7}"
        f"  {plan.checkpoint:<12}{schedule:<14}{balance:<16}"
        f"{p.step_time:>9.4f}{1e3 * p.seconds_per_row:>8.3f}{p.bubble:>8.1%}  {peaks}"
    )


def _entry(p: PlanPrediction) -> dict[str, Any]:
    stages = [{**vars(stage), "total": stage.total} for stage in p.memory]
    return {
        **p.plan.options(),
        "step_time": p.step_time,
        "seconds_per_row": p.seconds_per_row,
        "bubble": p.bubble,
        "peak_bytes": [stage["total"] for stage in stages],
        "stage_memory": stages,
    }


def no_plan_fits(report: PlanReport) -> ValueError:
    """The error for a limit no candidate fits, naming the smallest limit that would and the plan that needs it."""
    best = min(report.predictions, key=lambda p: p.peak_bytes)
    options = ", ".join(f"{key}={value!r}" for key, value in best.plan.options().items())
    return ValueError(
        f"No pipeline plan fits memory_limit={report.memory_limit:,.0f} bytes ({report.memory_limit / MIB:,.0f} MiB)"
        f" per device on {report.world_size} processes: the smallest limit that fits is"
        f" {report.smallest_fitting_limit:,.0f} bytes ({report.smallest_fitting_limit / MIB:,.0f} MiB), with {options}."
        " Raise the limit, use more devices, lower the batch size, or free a constraint."
    )
