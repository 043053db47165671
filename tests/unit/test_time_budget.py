"""The examples' TimeBudget (examples/time_budget.py): the last step set from the measured speed so that a recipe ends
its schedule, its final validation included, within its minutes from the command's start, on any machine."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import time_budget  # noqa: E402
from time_budget import TimeBudget  # noqa: E402


class Clock:
    """Stands for ``time.time``: the seconds since the command started, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _trainer() -> SimpleNamespace:
    broadcast = lambda obj, src=0: obj  # noqa: E731 - one process
    epoch_loop = SimpleNamespace(max_steps=1000)
    return SimpleNamespace(
        global_step=0, is_global_zero=True, should_stop=False, strategy=SimpleNamespace(broadcast=broadcast),
        fit_loop=SimpleNamespace(epoch_loop=epoch_loop), num_sanity_val_batches=[2], num_val_batches=[30],
        progress_bar_callback=None,
    )  # fmt: skip


def _run(budget: TimeBudget, trainer: SimpleNamespace, clock: Clock, seconds_per_step, steps: int) -> None:
    for _ in range(steps):
        clock.now += seconds_per_step(trainer.global_step)
        trainer.global_step += 1
        budget.on_train_batch_end(trainer, None, None, None, trainer.global_step - 1)
        if trainer.should_stop:
            return


def test_the_last_step_fills_the_budget_and_follows_the_speed(monkeypatch, caplog) -> None:
    """A 10-minute budget from a command that started 60 s before training, a sanity check of 2 validation batches in
    2 s (so 30 s for the 30 of the final validation), 2 s per step, 10 steps' time kept: the plan ends at 600 - 12 (2%
    margin) - 30 - 60 = 498 s of training, 249 steps, less the 10 kept; when the machine then slows to 4 s per step
    the plan moves earlier, and the run stops at its last step, in time."""
    clock = Clock()
    monkeypatch.setattr(time_budget, "time", SimpleNamespace(time=clock))
    budget = TimeBudget(minutes=10, skip_steps=5, measure_steps=20, replan_steps=50, reserve_steps=10)
    trainer = _trainer()
    budget.on_fit_start(trainer, None)
    budget.on_sanity_check_start(trainer, None)
    clock.now += 2.0
    budget.on_sanity_check_end(trainer, None)
    monkeypatch.setattr(time_budget, "command_started", lambda: clock.now - 60)
    budget.on_train_start(trainer, None)
    _run(budget, trainer, clock, lambda step: 2.0, 25)
    assert budget.validation_seconds == 30 and budget.last_step == trainer.fit_loop.epoch_loop.max_steps == 239
    assert "2.00 s per step at step 25, so 239 steps fit the 10-minute budget, keeping 30 s for the" in caplog.text
    _run(budget, trainer, clock, lambda step: 2.0 if step < 100 else 4.0, 1000)
    assert trainer.should_stop and trainer.global_step == budget.last_step < 239
    assert clock.now - (1002 - 60) + 30 + 10 * 4.0 <= 10 * 60  # the last step and the kept time end within it


@pytest.mark.parametrize(
    "kwargs",
    [dict(minutes=0), dict(minutes=1, measure_steps=0), dict(minutes=1, reserve_steps=-1), dict(minutes=1, margin=1)],
)
def test_a_bad_budget_is_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="TimeBudget"):
        TimeBudget(**kwargs)


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_the_progress_bar_takes_the_total_of_a_last_step_moved_within_its_epoch(tmp_path, kind) -> None:
    """Lightning sets the bar's total when an epoch starts, from ``max_steps`` (with ``max_epochs=-1``); a plan that
    moves the last step later in that epoch gives the bar its new total (the epoch's batches so far plus the steps
    left), so it never shows "183/170"; for Lightning's TQDM and Rich bars."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.demos.boring_classes import BoringModel

    if kind == "rich":
        pytest.importorskip("rich")
    bar = TQDMProgressBar() if kind == "tqdm" else RichProgressBar()
    totals = []

    def total() -> float:
        if kind == "tqdm":
            return bar.train_progress_bar.total
        return bar.progress.tasks[bar.train_progress_bar_id].total

    class Move(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if trainer.global_step == 3:  # as TimeBudget._plan moves it
                trainer.fit_loop.epoch_loop.max_steps = 8
                time_budget.retotal_progress_bar(trainer)
            totals.append(total())

    trainer = pl.Trainer(
        max_epochs=None, max_steps=5, callbacks=[bar, Move()], accelerator="cpu", devices=1,
        logger=False, enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(BoringModel())
    assert trainer.global_step == 8 and totals == [5, 5] + [8] * 6
