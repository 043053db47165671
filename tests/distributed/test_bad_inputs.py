"""The table of bad inputs (docs/contract.md, "Bad inputs"), the mistakes that only show once the stages start:
one distributed worker (tests/workers/failure.py ``bad_inputs``) runs each as a fit that must fail on every stage
alike before its first step, naming the fix, and no process may be left behind. Arguments and the engine's checks:
tests/unit/test_bad_inputs.py; the mistakes that fail one stage in the middle of a step (a second backbone call, a
layer's error, user code): tests/distributed/test_failures.py."""

import json

import pytest
from conftest import assert_every_stage_exits, shared_run

STAGES = {
    "balance_sum": "ValueError: balance=[1, 1] sums to 2 but the backbone has 8 layers.",
    "balance_length": "ValueError: GPipeStrategy(balance=[3, 3, 2]) gives pipelines of 3 stages, which cannot fill",
    "balance_empty_stage": "ValueError: balance=[8, 0] leaves a stage empty; every stage needs at least one layer.",
    "backbone_name": "GPipeStrategy(backbone='trunk'): `TupleNet.trunk` is missing, not an nn.Sequential. Put the",
    "two_sequentials": "choose the one to pipeline with `GPipeStrategy(backbone='backbone')`",
    "no_sequential": "NoSequential has no nn.Sequential attribute to pipeline. Put the layers to split into stages",
    "more_devices_than_layers": "The backbone has 1 layers, fewer than the 2 stages (devices); use fewer devices",
    "manual_optimization": "RuntimeError: GPipeStrategy supports automatic optimization only",
    "impossible_memory_limit": "the smallest limit that fits is",
    "meta_layer_without_reset": "was created on the meta device but has no `reset_parameters()` to initialise it",
    "meta_buffer_unfilled": "a buffer registered with persistent=False, was created on the meta device and its"
    " module's `reset_parameters()` does not fill it",
    "training_batches_differ": "The stages have different numbers of training batches (stage 0: [3], stage 1: [2]);"
    " every stage runs every batch of the pipeline, so all stages need the same data loaders",
    "validation_batches_differ": "The stages have different numbers of validation batches (stage 0: [3], stage 1: [2])",
    "datasets_differ": "BatchMismatchError: The stages of a pipeline hold different training datasets (stage 0: 52 rows"
    " (fingerprint ",
    "validation_order_differs": "BatchMismatchError: The stages of a pipeline read different batches at epoch 0,"
    " validation batch 0 (batch fingerprints stage 0: ",
    "resume_from_a_plain_directory": "is not a sharded GPipe checkpoint: it has no meta.pt.",
}
SEED_THE_DATA = {"datasets_differ": "Seed before you build the data: call `lightning.seed_everything(SEED)`"}
"""The second half of a message, checked apart from its first (the fingerprints between them differ per run)."""


BAD_INPUTS = shared_run("failure.py", "bad_inputs", "{out}", devices=2, timeout=400, name="bad_inputs")


@pytest.fixture(scope="module")
def stage_errors():
    """Each rank's messages for every case of the worker's ``BAD_INPUTS``, from one run of 2 stage processes (which
    go on to run other scripts, see ``shared_run``)."""
    out = BAD_INPUTS()
    assert_every_stage_exits(out, within=30)
    return [json.loads((out / f"bad_inputs_rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("case", STAGES)
def test_a_bad_input_fails_every_stage_before_the_first_step_naming_the_fix(stage_errors, case):
    for messages in stage_errors:
        assert STAGES[case] in messages[case], messages[case]
        assert SEED_THE_DATA.get(case, "") in messages[case], messages[case]
