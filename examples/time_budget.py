"""A run planned in steps that spends a wall-clock budget: the examples' time-budgeted recipes use it.

A recipe named for a time ("20 minutes on 2 CPU cores") must fill that time on a fast machine and still end its
learning-rate schedule within it on a slow one, so a fixed ``max_steps`` does not do (it leaves time unused on the
first, and ``max_time`` cuts the second off with the learning rate still high). :class:`TimeBudget` measures the
speed of the first steps and sets ``Trainer(max_steps)`` to the steps that fit; the examples' learning-rate schedules
read ``trainer.max_steps`` at every step (``amoebanet.module.one_cycle``, ``translation.module.cooldown``), so they
end there.
"""

import math
import time
from typing import Any

import lightning.pytorch as pl
import psutil
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf
from lightning.pytorch.utilities import rank_zero_info


def command_started() -> float:
    """When this process started, in seconds since the epoch (``psutil.Process().create_time()``): under Lightning's
    launchers global rank 0 is the process of the command the user typed, so this is when the command started."""
    return psutil.Process().create_time()


class TimeBudget(Callback):
    """Set ``Trainer(max_steps)`` to the steps that fit in ``minutes`` from the command's start, on this machine.

    After ``skip_steps`` steps (start-up: the first steps run slower), global rank 0 times ``measure_steps`` steps,
    and every process sets the run's last step (``trainer.fit_loop.epoch_loop.max_steps``, Lightning's own stop) to
    the step at which the time left runs out. It keeps the time of the final validation (measured: the time of
    Lightning's sanity check, ``Trainer(num_sanity_val_steps)`` batches, per batch, times the validation batches; none
    without a sanity check), of ``reserve_steps`` steps (the last checkpoint, the end of the processes), and a
    ``margin`` of the budget for the speed to vary. Every ``replan_steps`` steps after that (more often as the last
    step nears: half the steps left) it measures again, the slower of the mean speed of all the timed steps and the
    speed since the previous plan, and moves the last step if the time left calls for it, so that a machine that
    slows down (or speeds up) mid-run still ends the schedule in time. At the last step it asks Lightning to stop
    (``trainer.should_stop``), which validates once more when ``check_val_every_n_epoch`` is ``None``, as after
    early stopping. Each plan that moves the last step by more than 1% is printed on global rank 0, and the
    progress bar takes the total it makes (:func:`retotal_progress_bar`).

    A schedule over ``max_steps`` must read it when it is used, not when the optimizer is configured (the
    learning-rate factors of the examples call ``trainer.max_steps`` at every step); until the first plan the run
    follows the ``max_steps`` it was given, a guess whose only role is the schedule's first ``skip_steps +
    measure_steps`` steps.

    Args:
        minutes: the budget, from the start of the command (:func:`command_started`) to the end of the final
            validation and checkpoint.
        skip_steps: steps not timed, at the start of training. Default 5.
        measure_steps: steps timed before the first plan. Default 20.
        replan_steps: steps between plans after the first. Default 50.
        reserve_steps: time kept after the last step besides the final validation, in steps (so that it scales
            with the machine's speed). Default 0.
        margin: share of the budget kept free for the speed to vary. Default 0.02.

    Raises:
        ValueError: for ``minutes <= 0``, step counts below 1 (``reserve_steps`` below 0), or a ``margin`` outside
            [0, 1).
    """

    def __init__(
        self,
        minutes: float,
        skip_steps: int = 5,
        measure_steps: int = 20,
        replan_steps: int = 50,
        reserve_steps: float = 0.0,
        margin: float = 0.02,
    ) -> None:
        if minutes <= 0 or min(skip_steps, measure_steps, replan_steps) < 1 or reserve_steps < 0:
            raise ValueError(
                f"TimeBudget(minutes={minutes}, skip_steps={skip_steps}, measure_steps={measure_steps}, replan_steps="
                f"{replan_steps}, reserve_steps={reserve_steps}): give a positive budget, step counts >= 1 and a"
                " reserve >= 0."
            )
        if not 0 <= margin < 1:
            raise ValueError(f"TimeBudget(margin={margin}): give the share of the budget kept free, in [0, 1).")
        self.minutes, self.skip_steps, self.measure_steps = minutes, skip_steps, measure_steps
        self.replan_steps, self.reserve_steps, self.margin = replan_steps, reserve_steps, margin
        self.validation_seconds = 0.0  # global rank 0: the final validation's expected time
        self.last_step: int | None = None  # the last step of the current plan (every process)
        self._deadline = 0.0  # global rank 0: when training must end, in seconds since the epoch
        self._timed: list[tuple[int, float]] = []  # global rank 0: (step, time) when timing started, at each plan
        self._next_plan = skip_steps + measure_steps

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """No validation measured yet (a sanity check, if any, measures it next)."""
        self.validation_seconds = 0.0

    def on_sanity_check_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start timing the sanity check's validation batches."""
        self.validation_seconds = -time.time()

    def on_sanity_check_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """The final validation's time: the sanity check's per batch, times the validation batches."""
        checked, batches = sum(trainer.num_sanity_val_batches), sum(trainer.num_val_batches)
        per_batch = (self.validation_seconds + time.time()) / max(checked, 1)
        self.validation_seconds = per_batch * batches if checked and math.isfinite(batches) else 0.0

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Start the clock: training ends before ``minutes`` after the command started, less the kept time."""
        self._deadline = command_started() + (1 - self.margin) * 60 * self.minutes - self.validation_seconds
        self.last_step, self._timed = None, []
        self._next_plan = trainer.global_step + self.skip_steps + self.measure_steps

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Time the steps, plan the last step when it is due, and stop the run at the last step."""
        step = trainer.global_step
        if not self._timed and step == self._next_plan - self.measure_steps:
            self._timed.append((step, time.time()))
        if step >= self._next_plan:
            self._plan(trainer, step)
            self._next_plan = step + max(min(self.replan_steps, (self.last_step - step) // 2), 1)
        if self.last_step is not None and step >= self.last_step:
            trainer.should_stop = True

    def _plan(self, trainer: "pl.Trainer", step: int) -> None:
        """Global rank 0 decides the last step from the speed, the slower of the mean over every timed step (which
        steadies the plan, and with it the schedule, as the run goes on) and the speed since the previous plan (so that
        a slowdown is not averaged away); every process takes it."""
        decided = None
        if trainer.is_global_zero:
            now = time.time()
            self._timed.append((step, now))
            (first, started), (previous, since) = self._timed[0], self._timed[-2]
            seconds_per_step = max((now - started) / (step - first), (now - since) / (step - previous))
            steps_left = int((self._deadline - now) / seconds_per_step - self.reserve_steps)
            decided = (step + max(steps_left, 0), seconds_per_step)
        last_step, seconds_per_step = trainer.strategy.broadcast(decided, src=0)
        if self.last_step is None or abs(last_step - self.last_step) > 0.01 * self.last_step:
            rank_zero_info(
                f"TimeBudget: {seconds_per_step:.2f} s per step at step {step}, so {last_step} steps fit the"
                f" {self.minutes:g}-minute budget, keeping {self.validation_seconds:.0f} s for the final validation"
                f" and {self.reserve_steps:g} steps' time: training ends at step {last_step}."
            )
        self.last_step = last_step
        trainer.fit_loop.epoch_loop.max_steps = last_step
        retotal_progress_bar(trainer)


def retotal_progress_bar(trainer: "pl.Trainer") -> None:
    """Give the training progress bar of the current epoch the total that the moved last step makes. With
    ``max_epochs=-1`` Lightning's bars take ``min(batches per epoch, max_steps - global_step)`` when an epoch starts
    (``ProgressBar.total_train_batches``), so in the last epoch a plan made after that would show "183/170"; the
    total becomes the epoch's batches so far plus the steps left. Lightning's two bars (Rich, TQDM) are updated;
    another progress bar, or none, is left as it is."""
    bar, epoch_loop = trainer.progress_bar_callback, trainer.fit_loop.epoch_loop
    if bar is None or bar.is_disabled or trainer.max_epochs != -1:
        return
    so_far = epoch_loop.batch_progress.current.ready
    total = min(trainer.num_training_batches, so_far + epoch_loop.max_steps - trainer.global_step)
    if isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
        bar.progress.update(bar.train_progress_bar_id, total=total)
    elif isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
        bar.train_progress_bar.total = convert_inf(total)
        bar.train_progress_bar.refresh()
