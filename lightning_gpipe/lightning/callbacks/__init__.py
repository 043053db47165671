"""Callbacks that make the pipeline visible: balance, throughput, timeline and the model summary.

Balance, throughput and timeline record every stage's spans during training steps (see
:mod:`lightning_gpipe.engine.events`), gather them on global rank 0, and write into the logger's ``log_dir`` (or the
trainer's ``default_root_dir``); under a strategy other than ``GPipeStrategy`` they warn and do nothing.
:class:`PipelineModelSummary` (from :mod:`lightning_gpipe.lightning.summary`, which the strategy uses to replace
Lightning's summary) shows the whole model and its split at fit start.
"""

from lightning_gpipe.lightning.callbacks.balance import PipelineBalance
from lightning_gpipe.lightning.callbacks.throughput import PipelineThroughput
from lightning_gpipe.lightning.callbacks.timeline import PipelineTimeline, draw_timeline
from lightning_gpipe.lightning.summary import PipelineModelSummary, StageSummary, replace_model_summary

__all__ = [
    "PipelineBalance",
    "PipelineModelSummary",
    "PipelineThroughput",
    "PipelineTimeline",
    "StageSummary",
    "draw_timeline",
    "replace_model_summary",
]
