"""The pipeline callbacks without GPipeStrategy: each warns and does nothing (on a real 2-stage run:
tests/distributed/test_callbacks.py)."""

import warnings

import lightning as L
from models import fit_trainer

from lightning_gpipe import PipelineBalance, PipelineThroughput, PipelineTimeline


def test_callbacks_warn_and_do_nothing_without_gpipe(tmp_path):
    callbacks = [PipelineBalance(warmup=0, steps=1), PipelineThroughput(), PipelineTimeline(steps=(0,))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_trainer(max_steps=2, callbacks=callbacks, default_root_dir=str(tmp_path))
    messages = " ".join(str(w.message) for w in caught)
    for name in ("PipelineBalance", "PipelineThroughput", "PipelineTimeline"):
        assert f"{name} measures the stages of GPipeStrategy; under SingleDeviceStrategy it does nothing" in messages
    assert list(tmp_path.iterdir()) == [] and callbacks[0].report is None and callbacks[2].written == []
    assert isinstance(callbacks[1], L.Callback)
