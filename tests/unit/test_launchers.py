"""What the launchers leave to the strategy, checked in this process: the spawn launcher's main process tears down a
strategy that ran no stage, and the launcher watch ignores the processes no launcher of the package started (the
launches themselves: tests/distributed/test_launchers.py and tests/distributed/test_failures.py)."""

import os

import lightning as L
from models import TupleNet

import lightning_gpipe  # noqa: F401 - registers "gpipe_spawn"
from lightning_gpipe.faults.failure import FailureBoard
from lightning_gpipe.faults.watchdog import LAUNCHER, mark_launcher, watch_launcher


def test_the_spawn_launchers_main_process_tears_down_a_module_it_never_attached():
    # when a stage fails under gpipe_spawn, Lightning tears down the main process's strategy, whose module (the
    # user's, given to fit) was never attached to the Trainer nor split: the stage's error must stay the last one
    trainer = L.Trainer(strategy="gpipe_spawn", accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    module = TupleNet()
    trainer.strategy.connect(module)
    trainer.strategy.teardown()
    assert trainer.strategy.run is None and module.device.type == "cpu"


def test_the_launcher_watch_watches_only_a_process_that_a_launcher_started():
    mark_launcher()  # this process, as the main process of a job: it launched the others, nothing launched it
    assert os.environ[LAUNCHER] == str(os.getpid()) and watch_launcher("stage 0", FailureBoard) is None
    del os.environ[LAUNCHER]  # a process of torchrun or SLURM
    assert watch_launcher("stage 0", FailureBoard) is None
