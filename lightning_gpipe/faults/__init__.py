"""The run's job: what lets a failure or a stall on one stage stop every stage, naming it.

:class:`~lightning_gpipe.faults.job.Job` holds one run's :class:`~lightning_gpipe.faults.failure.FailureBoard`, the
stage's :class:`~lightning_gpipe.faults.watchdog.Position` and stall watchdog, and the helper threads of the
interruptible waits of transfers and of the package's collectives (:mod:`~lightning_gpipe.faults.waiting`). The
bottom layer: it imports nothing else of the package.

Its front door is this package: the names below are everything the layers above (the engine, the adapters) use of
it; its modules are its internals. ``waiting`` is the one module among them, the waits and the package's collectives,
which every caller names as a namespace (``waiting.broadcast(job, tensor, src)`` beside ``dist.broadcast``).
"""

from lightning_gpipe.faults import waiting
from lightning_gpipe.faults.failure import PipelineFailure
from lightning_gpipe.faults.job import Job
from lightning_gpipe.faults.watchdog import LauncherWatch, Position, mark_launcher, watch_launcher

__all__ = [
    # the run's job and the error it raises
    "Job",
    "PipelineFailure",
    # where a stage is, for its stall's message
    "Position",
    # the waits and the collectives, each interruptible by a failure or a stall
    "waiting",
    # a launched process that ends once its launcher has
    "LauncherWatch",
    "mark_launcher",
    "watch_launcher",
]
