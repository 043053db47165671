"""Signals that stop or requeue a job, taken at a step that every process agrees on.

A signal reaches each stage process at a different point of its step: one in its fill, another in a transfer
or an optimizer step. Lightning acts on SIGTERM and SLURM's requeue signal where they land: its SIGTERM handler
broadcasts from rank 0 inside the handler (which can pair with another stage's collective), marks the trainer,
and its loop then checks the mark locally at the end of every batch, so a stage that is a step ahead of the
others stops one step later than they do; its requeue handler saves a checkpoint inside the handler. Here a
handler only marks the request (:class:`StopSignals`); the marks travel with the stages' agreement before each
step (:class:`~lightning_gpipe.lightning.agreement.StepAgreement`), and every process acts on the agreed requests at the
same point (:meth:`StopSignals.act`): SIGTERM sets Lightning's mark on every process at once, so its loop ends
every stage after the same step; a requeue saves Lightning's HPC checkpoint on every stage and requeues the job.

SIGINT must end the job even where the process inherited it ignored (a background job of a non-interactive
shell ignores it, so ``kill -INT`` would do nothing): during a run it raises ``KeyboardInterrupt`` in the main
thread, which Lightning turns into a shutdown that ends every stage process.
"""

import signal
import threading
from typing import Any, cast

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_gpipe.lightning._lightning import mark_sigterm, original_signal_handler, requeue

SIGTERM, REQUEUE = 0, 1
"""Indices of the requests in :meth:`StopSignals.requests`."""


class StopSignals:
    """Marks SIGTERM and SLURM's requeue signal, and acts on them once the processes agree (see the module
    docstring). One per run; handlers are installed in the main thread only.

    Args:
        trainer: the running Trainer (its signal connector holds Lightning's SIGTERM mark and requeue handler).
        launcher: the strategy's launcher, which forwards a SIGTERM to the processes it started.
        environment: the cluster environment; under ``SLURMEnvironment(auto_requeue=True)`` the requeue signal is
            handled too.
    """

    def __init__(self, trainer: "pl.Trainer", launcher: Any | None, environment: Any | None) -> None:
        self.trainer, self.launcher = trainer, launcher
        self.marks = [False, False]
        requeue = isinstance(environment, SLURMEnvironment) and environment.auto_requeue
        slurm = cast(SLURMEnvironment, environment)  # when ``requeue``: checked by the isinstance above
        self.requeue_signal: signal.Signals | None = slurm.requeue_signal if requeue else None

    def install(self) -> None:
        """Replace Lightning's SIGTERM and requeue handlers by marking ones, and let SIGINT raise
        ``KeyboardInterrupt`` (Lightning's signal connector restores every handler when the run ends)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            signal.signal(signal.SIGINT, signal.default_int_handler)
        previous = original_signal_handler(self.trainer, signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if not self.marks[SIGTERM] and self.launcher is not None:
                self.launcher.kill(signum)  # the processes it started get the signal too, as with Lightning's
            self.marks[SIGTERM] = True
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)
        if self.requeue_signal is not None and original_signal_handler(self.trainer, self.requeue_signal) in (
            None,
            signal.SIG_DFL,
        ):  # Lightning leaves a handler of the user's in place, and so do we
            signal.signal(self.requeue_signal, lambda signum, frame: self._mark(REQUEUE))
        else:
            self.requeue_signal = None

    def _mark(self, request: int) -> None:
        self.marks[request] = True

    def requests(self) -> list[bool]:
        """This process's marks, in the order of :data:`SIGTERM` and :data:`REQUEUE`, for the agreement."""
        return list(self.marks)

    def act(self, agreed: list[bool], training: bool) -> None:
        """Act on the requests agreed by every process (the same call on every process, at the same step).

        A SIGTERM sets Lightning's mark, so that its loops stop every stage at the end of this batch. A requeue
        (in training only; it stays pending during evaluation) saves Lightning's HPC checkpoint on every stage,
        has global rank 0 run ``scontrol requeue`` (Lightning's own handler), and ends every stage.

        Raises:
            SIGTERMException: after a requeue's checkpoint, as SLURM's SIGTERM after the requeue would end the job.
        """
        if agreed[SIGTERM]:
            self.marks[SIGTERM] = True
            mark_sigterm(self.trainer)
        if agreed[REQUEUE] and training and self.requeue_signal is not None:
            # every stage names the file before any writes it (the save starts with collectives): the same path
            requeue(self.trainer, self.requeue_signal)
            rank_zero_info("Saved the checkpoint and requeued the job; ending every stage.")
            raise SIGTERMException
