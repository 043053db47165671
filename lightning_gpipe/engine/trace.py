"""One training step of the whole pipeline: every stage's spans on one clock, and what they add up to.

A :class:`StepTrace` is what the callbacks gather from the stages (measured) and what the simulator
predicts (:mod:`lightning_gpipe.planning.simulator`), so both are summarised, drawn and exported the same way.

Bubble and efficiency (GPipe, Huang et al. 2019, section 2.2): a stage is *busy* while it computes
(forward, recompute, backward, the last stage's loss, the optimizer step) and idle otherwise, including
while it waits for a neighbour. Its efficiency is its busy time over the step's wall time; the bubble is
the mean idle share, ``1 - mean(efficiency)``. For K equal stages, M micro-batches and nothing but
forward and backward, it is the paper's ``(K - 1) / (M + K - 1)``.
"""

from dataclasses import dataclass, field, replace

from lightning_gpipe.engine.events import TRANSFER, WORK, Span, peak_activation_bytes


@dataclass
class StageTrace:
    """What one stage did in one step.

    Args:
        stage: pipeline rank (0-based).
        spans: the stage's spans, in ``time.perf_counter()`` seconds.
        start: when the step started on this stage (seconds, same clock).
        end: when it ended.
        layers: number of backbone layers of the stage.
        parameters: number of parameter elements of the stage's layers (the backbone part only).
    """

    stage: int
    spans: list[Span]
    start: float
    end: float
    layers: int = 0
    parameters: int = 0

    def shifted(self, seconds: float) -> "StageTrace":
        """This trace with every time moved by ``seconds`` (onto another process's clock)."""
        spans = [span._replace(start=span.start + seconds, end=span.end + seconds) for span in self.spans]
        return replace(self, spans=spans, start=self.start + seconds, end=self.end + seconds)

    def total(self, kind: str) -> float:
        """Seconds spent in spans of ``kind``."""
        return sum(s.end - s.start for s in self.spans if s.kind == kind)

    @property
    def busy(self) -> float:
        """Seconds spent computing (spans of a kind in :data:`lightning_gpipe.engine.events.WORK`)."""
        return sum(self.total(kind) for kind in WORK)

    @property
    def peak_activation_bytes(self) -> int:
        """Peak activation memory of the step (see :func:`lightning_gpipe.engine.events.peak_activation_bytes`)."""
        return peak_activation_bytes(self.spans)


@dataclass
class StepTrace:
    """Every stage's :class:`StageTrace` of one step, indexed by stage.

    Args:
        step: the training batch index (``trainer.fit_loop.total_batch_idx``), or 0 for a simulated step.
        stages: one :class:`StageTrace` per stage, in stage order.
    """

    step: int
    stages: list[StageTrace] = field(default_factory=list)

    @property
    def start(self) -> float:
        """Earliest start of the step on any stage (seconds)."""
        return min(s.start for s in self.stages)

    @property
    def end(self) -> float:
        """Latest end of the step on any stage (seconds)."""
        return max(s.end for s in self.stages)

    @property
    def wall(self) -> float:
        """The step's wall time: from the earliest start to the latest end (seconds)."""
        return self.end - self.start

    @property
    def micro_batches(self) -> int:
        """M, the number of micro-batches seen in the spans (0 without any)."""
        return 1 + max((s.micro_batch for st in self.stages for s in st.spans if s.micro_batch is not None), default=-1)

    @property
    def efficiency(self) -> list[float]:
        """Per stage, busy time over the step's wall time (0 to 1)."""
        return [s.busy / self.wall if self.wall > 0 else 0.0 for s in self.stages]

    @property
    def bubble(self) -> float:
        """The mean share of the step the stages are not busy (idle or waiting), ``1 - mean(efficiency)``."""
        efficiency = self.efficiency
        return 1.0 - sum(efficiency) / len(efficiency)

    def idle(self, stage: int) -> list[tuple[float, float]]:
        """Intervals ``(start, end)`` of the step's wall time during which ``stage`` neither computes nor transfers."""
        covered = sorted((s.start, s.end) for s in self.stages[stage].spans if s.kind in WORK + TRANSFER)
        gaps, cursor = [], self.start
        for start, end in covered:
            if start > cursor:
                gaps.append((cursor, start))
            cursor = max(cursor, end)
        if self.end > cursor:
            gaps.append((cursor, self.end))
        return gaps

    def to_chrome(self) -> dict:
        """The step in Chrome's Trace Event Format (opens in Perfetto and ``chrome://tracing``).

        One process per stage (``pid`` = stage), lanes (``tid``) 0 compute, 1 transfer, 2 idle; complete
        (``"X"``) events with microsecond ``ts`` from the step's start. Named like the GPipe paper's Figure 2:
        ``F3`` forward, ``R3`` recompute, ``B3`` backward of micro-batch 3.
        """
        events = []
        for stage in self.stages:
            events.append(_meta("process_name", stage.stage, 0, {"name": f"stage {stage.stage}"}))
            events.append(_meta("process_sort_index", stage.stage, 0, {"sort_index": stage.stage}))
            for lane, name in enumerate(LANES):
                events.append(_meta("thread_name", stage.stage, lane, {"name": name}))
            for span in stage.spans:
                events.append(self._event(stage.stage, label(span), span.kind, _lane(span.kind), span.start, span.end))
            for start, end in self.idle(stage.stage):
                events.append(self._event(stage.stage, "idle", "idle", 2, start, end))
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _event(self, pid: int, name: str, category: str, tid: int, start: float, end: float) -> dict:
        # rounding both ends (not the duration) keeps back-to-back events on one lane from overlapping
        ts, te = (round((t - self.start) * 1e6, 1) for t in (start, end))
        return {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": round(te - ts, 1)}


LANES = ("compute", "transfer", "idle")
"""Names of the lanes (trace ``tid``) of each stage."""


def label(span: Span) -> str:
    """Short name of a span as in the GPipe paper's Figure 2: ``F3``, ``R3``, ``B3`` (and zero-bubble's ``W3``, the
    deferred weight gradient); else its kind."""
    prefix = {"forward": "F", "recompute": "R", "backward": "B", "weight": "W"}.get(span.kind)
    if prefix is None or span.micro_batch is None:
        return span.kind if span.micro_batch is None else f"{span.kind} {span.micro_batch}"
    return f"{prefix}{span.micro_batch}"


def _lane(kind: str) -> int:
    return 1 if kind in TRANSFER else 0


def _meta(name: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
