"""GPipeStrategy(compile=...) on 2 stage processes under ZB-H1 (one run of tests/workers/compiled.py, in the shared
2-process launch) against single-device Lightning; in-process checks: tests/unit/test_compile.py."""

import json
import os

import pytest
import torch
from conftest import assert_states_close, shared_run
from models import TupleNet
from rowwise import fit_batches

INDUCTOR_BUILDS = os.environ.get("ATEN_CPU_CAPABILITY") != "default"
"""torch 2.13's inductor writes vectorized C++ (``at::vec``) that does not build with ``ATEN_CPU_CAPABILITY=default``
(the setting that lets one CPU stand in for another's kernels): the compiled run is left out there."""

COMPILED = shared_run("compiled.py", "--devices=2", devices=2) if INDUCTOR_BUILDS else None


@pytest.mark.skipif(not INDUCTOR_BUILDS, reason="inductor's C++ does not build under ATEN_CPU_CAPABILITY=default")
def test_compiled_stages_under_zero_bubble_equal_one_device():
    assert COMPILED is not None  # registered wherever inductor builds
    runs = COMPILED()
    expected = fit_batches(module=lambda: TupleNet(blocks=2), max_steps=2).lightning_module.state_dict()
    assert_states_close(torch.load(runs / "zb_h1.pt"), expected)  # same names, same weights at 1e-5
    seen = [json.loads((runs / f"compiled_rank{rank}.json").read_text()) for rank in range(2)]
    assert sum(stage["layers"] for stage in seen) == 4
    for stage in seen:  # each stage compiled all of its layers, and gave them back uncompiled
        assert stage["compiled"] == stage["layers"] > 0 and stage["after"] == 0, seen
