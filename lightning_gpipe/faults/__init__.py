"""The run's job: what lets a failure or a stall on one stage stop every stage, naming it.

:class:`~lightning_gpipe.faults.job.Job` holds one run's :class:`~lightning_gpipe.faults.failure.FailureBoard`, the
stage's :class:`~lightning_gpipe.faults.watchdog.Position` and stall watchdog, and the helper threads of the
interruptible waits of transfers and of the package's collectives (:mod:`~lightning_gpipe.faults.waiting`). The
bottom layer: it imports nothing else of the package.
"""
