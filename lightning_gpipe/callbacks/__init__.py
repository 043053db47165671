"""Callbacks that make the pipeline visible: balance, throughput and timeline.

All three record every stage's spans during training steps (see :mod:`lightning_gpipe.events`), gather
them on global rank 0, and write into the logger's ``log_dir`` (or the trainer's ``default_root_dir``).
Under a strategy other than ``GPipeStrategy`` they warn and do nothing.
"""

from lightning_gpipe.callbacks.balance import PipelineBalance
from lightning_gpipe.callbacks.throughput import PipelineThroughput
from lightning_gpipe.callbacks.timeline import PipelineTimeline, draw_timeline

__all__ = ["PipelineBalance", "PipelineThroughput", "PipelineTimeline", "draw_timeline"]
