"""GPipeStrategy's options (lightning_gpipe/lightning/config.py): one table of the allowed names, which the type hints,
the engine and the docstrings agree with; every allowed value is accepted by ``GPipeStrategy`` and by each example's
command line, and a bad value or type is refused before any process starts. The docs' values: test_doc_commands.py;
each bad argument's message: test_bad_inputs.py."""

import inspect
import sys
from datetime import timedelta
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from models import fit_trainer

from lightning_gpipe import GPipeStrategy
from lightning_gpipe.engine.rematerialization import CHECKPOINT_MODES
from lightning_gpipe.engine.schedule import SCHEDULES
from lightning_gpipe.lightning.config import (
    CHOICES,
    BalanceMode,
    CheckpointMode,
    OffloadMode,
    PipelineConfig,
    ScheduleName,
    one_stage_warning,
)
from lightning_gpipe.planning.balance import MODES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))

PARAMETERS = inspect.signature(GPipeStrategy).parameters

VALUES = {option: allowed for option, (allowed, _) in CHOICES.items()}
VALUES |= {"balance": MODES, "plan": ("auto",), "offload": get_args(OffloadMode)}
"""Every named value each option takes (the docs offer these; tests/unit/test_doc_commands.py holds them to it)."""


def literal_values(annotation: object) -> set:
    """The values of every ``Literal`` in ``annotation``, through ``Optional`` and ``Union``."""
    if get_origin(annotation) is Literal:
        return set(get_args(annotation))
    return set().union(*(literal_values(argument) for argument in get_args(annotation)))


def test_the_type_hints_the_table_the_engine_and_the_docstring_name_the_same_values() -> None:
    assert get_args(ScheduleName) == tuple(SCHEDULES)
    assert get_args(CheckpointMode) == CHECKPOINT_MODES
    assert get_args(BalanceMode) == MODES
    fields = PipelineConfig.__dataclass_fields__
    for option, (allowed, fix) in CHOICES.items():
        assert literal_values(PARAMETERS[option].annotation) == set(allowed), option
        assert literal_values(fields[option].type) == set(allowed), option
        assert all(f"'{value}'" in fix or value in fix for value in allowed), fix  # the error lists them all
    assert literal_values(PARAMETERS["balance"].annotation) == set(MODES)
    for schedule in SCHEDULES:
        assert f'``"{schedule}"``' in GPipeStrategy.__doc__ and f'``"{schedule}"``' in PipelineConfig.__doc__


@pytest.mark.parametrize("option", VALUES)
def test_every_value_of_an_option_is_accepted(option: str) -> None:
    for value in VALUES[option]:
        assert getattr(GPipeStrategy(**{option: value}).config, option) == value


def _strategy_arguments(index: int) -> list[str]:
    """One command line's strategy options: the ``index``-th value of each option (cycling through the shorter)."""
    arguments = ["--trainer.strategy=lightning_gpipe.GPipeStrategy"]
    arguments += [f"--trainer.strategy.{option}={values[index % len(values)]}" for option, values in VALUES.items()]
    return arguments + ["--trainer.strategy.timeout=0:10:00", "--trainer.strategy.stall_timeout=0:00:30"]


@pytest.mark.parametrize("example", ["amoebanet", "translation", "causal_lm"])
def test_every_value_of_every_option_is_accepted_by_each_examples_command_line(example, monkeypatch) -> None:
    """Each example's LightningCLI parses every value (the type hints are what it checks), and the parsed options
    make a strategy; a bad value or a bad type (seconds for a timedelta) stops the parse."""
    train = __import__(f"{example}.train").train
    monkeypatch.setattr(sys, "argv", ["train.py"])
    parser = train.main([], run=False).parser
    for index in range(max(len(values) for values in VALUES.values())):
        parsed = parser.parse_args(_strategy_arguments(index))
        config = GPipeStrategy(**parsed.trainer.strategy.init_args.as_dict()).config
        assert config.schedule == VALUES["schedule"][index % len(VALUES["schedule"])]
        assert config.timeout == timedelta(minutes=10) and config.stall_timeout == timedelta(seconds=30)
    for bad in ("--trainer.strategy.schedule=zb-2p", "--trainer.strategy.timeout=30"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--trainer.strategy=lightning_gpipe.GPipeStrategy", bad])


def test_devices_left_out_on_a_cpu_warn_that_the_pipeline_has_one_stage() -> None:
    """Trainer(devices="auto"), the default, is one process on a CPU: a pipeline of one stage, which the strategy says
    loudly, naming the fix; one stage asked for (pipeline_parallel_size=1, a one-entry balance), several stages, or a
    GPU say nothing."""
    with pytest.warns(PossibleUserWarning, match=r"pipeline of one stage.*Trainer\(accelerator='cpu', devices=2\)"):
        fit_trainer(strategy="gpipe", devices="auto", max_steps=1)
    assert one_stage_warning(PipelineConfig(), 1, "cpu") is not None
    for config, stages, device in [
        (PipelineConfig(pipeline_parallel_size=1), 1, "cpu"),
        (PipelineConfig(balance=[8]), 1, "cpu"),
        (PipelineConfig(), 2, "cpu"),
        (PipelineConfig(), 1, "cuda"),
    ]:
        assert one_stage_warning(config, stages, device) is None
