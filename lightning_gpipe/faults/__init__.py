"""The run's job: what lets a failure or a stall on one stage stop every stage, naming it.

:class:`~lightning_gpipe.faults.job.Job` holds one run's :class:`~lightning_gpipe.faults.failure.FailureBoard`, the
stage's :class:`~lightning_gpipe.faults.watchdog.Position` and stall watchdog, and the helper threads of the
interruptible waits (:mod:`~lightning_gpipe.faults.waiting`); :mod:`~lightning_gpipe.faults.collectives` are the
package's collectives through those waits. The bottom layer: it imports nothing else of the package.
"""
