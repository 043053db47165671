"""``python -m lightning_gpipe.consolidate`` explains itself (on a sharded checkpoint of a 2-stage run:
tests/distributed/test_consolidate.py)."""

import pytest

from lightning_gpipe.lightning.consolidate import COMMAND, main


def test_the_command_explains_itself(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    help = capsys.readouterr().out
    assert f"usage: {COMMAND} [-h] [--force] DIRECTORY OUTPUT" in help
    assert "load_from_checkpoint" in help and "example:" in help
