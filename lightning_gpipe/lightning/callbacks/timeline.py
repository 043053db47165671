"""PipelineTimeline: every stage's intervals in chosen steps, as a Perfetto trace and a Gantt chart."""

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_gpipe.engine import TRANSFER, StepTrace
from lightning_gpipe.lightning.callbacks._pipeline import PipelineCallback, log_dir

if TYPE_CHECKING:
    from matplotlib.figure import Figure

COLORS = {
    "forward": "#4c72b0",
    "recompute": "#a1c9f4",
    "backward": "#55a868",
    "weight": "#8de5a1",
    "loss": "#8172b2",
    "optimizer": "#937860",
    "recv": "#c44e52",
    "send": "#ff9f9b",
    "relay": "#fab0e4",
    "idle": "#e5e5e5",
}
"""Colour of each span kind in :func:`draw_timeline`."""


def draw_timeline(step: StepTrace, title: str | None = None) -> "Figure":
    """A Gantt chart of one step like the GPipe paper's Figure 2 (Huang et al. 2019).

    One row per stage (stage 0 on top), time in milliseconds from the step's start. Each row has a compute
    lane (forward, recompute, backward boxes numbered by micro-batch; loss; optimizer; idle in grey) and,
    under it, a thin transfer lane (receive waits, sends).

    Args:
        step: a measured or simulated :class:`~lightning_gpipe.engine.trace.StepTrace`.
        title: the chart's title; default: step number, M, wall time and bubble.

    Returns:
        A ``matplotlib.figure.Figure`` (not attached to pyplot, so no display is needed).

    Raises:
        ModuleNotFoundError: without matplotlib.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    figure = Figure(figsize=(12, 1.0 + 0.9 * len(step.stages)), dpi=100)
    axes = figure.add_subplot()
    scale = 1e3  # ms
    for stage in step.stages:
        row = len(step.stages) - 1 - stage.stage
        idle = [((a - step.start) * scale, (b - a) * scale) for a, b in step.idle(stage.stage)]
        axes.broken_barh(idle, (row + 0.25, 0.6), facecolors=COLORS["idle"])
        for span in stage.spans:
            start, width = (span.start - step.start) * scale, (span.end - span.start) * scale
            if span.kind in TRANSFER:
                axes.broken_barh([(start, width)], (row + 0.05, 0.15), facecolors=COLORS[span.kind])
                continue
            axes.broken_barh([(start, width)], (row + 0.25, 0.6), facecolors=COLORS[span.kind], edgecolor="white")
            if span.micro_batch is not None and width > step.wall * scale / 120:
                axes.text(start + width / 2, row + 0.55, str(span.micro_batch), ha="center", va="center", fontsize=7)
    axes.set_yticks([len(step.stages) - 1 - s.stage + 0.5 for s in step.stages])
    axes.set_yticklabels([f"stage {s.stage}" for s in step.stages])
    axes.set_ylim(0, len(step.stages))
    axes.set_xlim(0, step.wall * scale)
    axes.set_xlabel("time since the step's start (ms)")
    axes.set_title(
        title
        or f"step {step.step}: {len(step.stages)} stages, M={step.micro_batches},"
        f" {step.wall * scale:.0f} ms, bubble {100 * step.bubble:.0f}%"
    )
    axes.legend(
        handles=[Patch(color=color, label=kind) for kind, color in COLORS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if len(step.stages) < 3 else -0.2),
        ncol=len(COLORS),
        fontsize=8,
        frameon=False,
    )
    figure.tight_layout()
    return figure


class PipelineTimeline(PipelineCallback):
    """Writes the timeline of chosen training steps: a Chrome/Perfetto trace and a Gantt chart.

    For each chosen step, every stage's forward, recompute, backward, loss, optimizer, send, receive-wait
    and idle intervals, from real ``time.perf_counter`` timestamps on one clock (one machine; see
    :mod:`lightning_gpipe.engine.events`), gathered on global rank 0, which writes into the logger's ``log_dir``
    (or ``default_root_dir``):

    - ``pipeline_timeline_step{N}.json``: Trace Event Format (open in https://ui.perfetto.dev or
      ``chrome://tracing``), one process per stage; see :meth:`lightning_gpipe.engine.trace.StepTrace.to_chrome`;
    - ``pipeline_timeline_step{N}.png``: :func:`draw_timeline`'s chart (needs matplotlib).

    The chart is saved beside every logger's files, not only the first one's: into each other logger's own
    ``log_dir`` too (``CSVLogger``, ``TensorBoardLogger``), so a CSV-only run has it next to ``metrics.csv``. It is
    also sent where the logger takes an image or a file: ``experiment.add_figure`` (TensorBoard) or ``log_image``
    (e.g. Weights & Biases) under ``pipeline/timeline``, and ``experiment.log_artifact(run_id, path, "pipeline")``
    (MLflow: an artifact of the run, under ``pipeline/``).

    Args:
        steps: training batch indices to record, counted from 0 across epochs (default ``(2,)``: the third
            step, after the first sets up the connections).
    """

    def __init__(self, steps: Sequence[int] = (2,)) -> None:
        self.steps = set(steps)
        self.written: list[str] = []

    @override
    def wants(self, batch: int) -> bool:
        """The chosen steps."""
        return batch in self.steps

    @override
    def on_step(self, trainer: "pl.Trainer", step: StepTrace) -> None:
        """Write and log the step's timeline."""
        base = os.path.join(log_dir(trainer), f"pipeline_timeline_step{step.step}")
        with open(base + ".json", "w") as f:
            json.dump(step.to_chrome(), f)
        figure = draw_timeline(step)
        png = base + ".png"
        figure.savefig(png)
        self.written += [base + ".json", png]
        for logger in trainer.loggers:
            own = getattr(logger, "log_dir", None)
            if isinstance(own, str) and os.path.abspath(own) != os.path.abspath(os.path.dirname(png)):
                os.makedirs(own, exist_ok=True)
                figure.savefig(os.path.join(own, os.path.basename(png)))
                self.written.append(os.path.join(own, os.path.basename(png)))
            experiment: Any = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_figure"):
                experiment.add_figure("pipeline/timeline", figure, global_step=trainer.global_step)
            elif hasattr(logger, "log_image"):
                logger.log_image(key="pipeline/timeline", images=[png], step=trainer.global_step)
            elif hasattr(experiment, "log_artifact") and getattr(logger, "run_id", None) is not None:
                # MLflow's MlflowClient.log_artifact, with MLFlowLogger's run_id (checked above)
                experiment.log_artifact(logger.run_id, png, "pipeline")  # type: ignore[attr-defined]
