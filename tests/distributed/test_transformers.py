"""Hugging Face models in the pipeline (lightning_gpipe.hf), distributed: tests/workers/transformers_hf.py in the shared
launches of 2, 3 and 4 processes (tiny models of tests/hf_families.py: 19 decoder classes, mixtures of experts and
recurrent ones (Mamba, Jamba) among them, 3 encoder classes and 2 encoder-decoders, T5's and Mamba's with LoRA too;
pipelined fit against the unmodified model trained on one device, 1F1B with balance="time", pipeline
replicas, a resume on another number of stages, pipelined greedy generation and the encoder-decoders' beam search
against ``generate``, ``save_pretrained`` after fit, LoRA adapters with ``peft``).

Every model is built from a small config (the hub is not reachable here).
"""

import json

import pytest
import torch
from conftest import (
    assert_states_close,
    assert_within_fp32_rounding,
    hf_one_device_optimizer,
    hf_train_one_device,
    hf_worker,
    shared_run,
    state_distance,
)
from hf_families import FIRST

transformers = pytest.importorskip("transformers")


# --------------------------------------------------------------------------- pipelined: 2 stages (and 3)


WORKER = hf_worker()
PIPELINED = [(family, k) for family in ("llama", "gpt2", "bert_mlm") for k in (2, 3)] + [("bert_classifier", 2)]
RUNS = {
    (family, k): shared_run(
        "transformers_hf.py", f"--devices={k}", f"--family={family}", devices=k, timeout=240, name=f"hf-{family}-{k}"
    )
    for family, k in PIPELINED
}
# every other family on 2 stages, found by structure: fit, and (decoders) decoding with the key/value caches; not
# Mistral's and Qwen2's sliding windows, tested on one device (tests/unit/test_transformers.py) and here by Gemma 2's,
# Gemma 3's and Cohere 2's
QUICK = {
    (family, 2): shared_run(
        "transformers_hf.py", "--devices=2", f"--family={family}", "--quick", devices=2, timeout=120,
        name=f"hf-{family}-2",
    )
    for family in WORKER.FAMILIES
    if family not in (*FIRST, "mistral", "qwen2")
}  # fmt: skip
# encoder-decoders on 2 stages: T5 (relative position bias; 7 layers and 4: the second stage starts at the second
# decoder block and holds the first one's bias table, a tie across the stages) and BART (learned positions,
# final_logits_bias), the encoder's output carried to the decoder's stages; fit, and greedy generation and beam search
# from the prompts as sources
SEQ2SEQ_RUNS = {
    (family, 2): shared_run(
        "transformers_hf.py", "--devices=2", f"--family={family}", "--quick", *balance, devices=2, timeout=120,
        name=f"hf-{family}-2",
    )
    for family, balance in (("t5", ["--balance=7,4"]), ("bart", []))
}  # fmt: skip
# LoRA adapters (peft) of the tied Llama on 2 stages, going on from a saved adapter with random A and B; its
# adapters-only checkpoint resumed on 4 stages, the last of which holds only frozen layers (norm, tied head)
LORA = shared_run(
    "transformers_hf.py", "--devices=2", "--family=llama", "--lora", devices=2, timeout=240, name="hf-llama-2-lora"
)
# LoRA of an encoder-decoder (T5) on 2 stages: fit only
LORA_SEQ2SEQ = shared_run(
    "transformers_hf.py", "--devices=2", "--family=t5", "--lora", "--quick", devices=2, timeout=240,
    name="hf-t5-2-lora",
)  # fmt: skip
# LoRA of a recurrent decoder (Mamba: adapters on its mixers' projections) on 2 stages: fit only
LORA_RECURRENT = shared_run(
    "transformers_hf.py", "--devices=2", "--family=mamba", "--lora", "--quick", devices=2, timeout=240,
    name="hf-mamba-2-lora",
)  # fmt: skip
LORA_RESUMED = shared_run(
    "transformers_hf.py", "--devices=4", "--family=llama", "--lora", "--resume=hf-llama-2-lora", devices=4,
    timeout=240, name="hf-llama-lora-resumed-4", output_of=2,
)  # fmt: skip
# 1F1B with the layers balanced by profiled time, on 3 stages: the classifier's loss is a mean over rows, so the
# row-weighted 1F1B loss equals one device's
RUNS["bert_classifier", 3] = shared_run(
    "transformers_hf.py", "--devices=3", "--family=bert_classifier", "--schedule=1f1b", "--balance=time",
    devices=3, timeout=240, name="hf-bert_classifier-3-1f1b",
)  # fmt: skip
# the 2-stage Llama's full checkpoint resumed on 3 stages (its directory is a sibling in the 2-process launch)
RESUMED = shared_run(
    "transformers_hf.py", "--devices=3", "--resume=hf-llama-2", devices=3, timeout=240,
    name="hf-llama-resumed-3", output_of=2,
)  # fmt: skip
# 2 pipeline replicas of 2 stages (4 processes, joining the other 4-process tests' launch): each replica half of
# every batch's rows, the classifier's row-mean loss making the averaged gradients one device's
DATA_PARALLEL = shared_run(
    "transformers_hf.py", "--devices=4", "--family=bert_classifier", "--data-parallel=2", devices=4, timeout=240,
    name="hf-bert_classifier-pp2-dp2",
)  # fmt: skip
# bf16-mixed (CPU autocast to bf16) on 2 stages, and the layers balanced by profiled memory on 3 (fit only: no
# checkpoint, no saved directory, no decoding)
BF16 = shared_run(
    "transformers_hf.py", "--devices=2", "--family=llama", "--precision=bf16-mixed", "--fit-only",
    devices=2, timeout=240, name="hf-llama-2-bf16",
)  # fmt: skip
MEMORY_BALANCED = shared_run(
    "transformers_hf.py", "--devices=3", "--family=gpt2", "--balance=memory", "--fit-only",
    devices=3, timeout=240, name="hf-gpt2-3-memory",
)  # fmt: skip
FITS = {**RUNS, **QUICK, **SEQ2SEQ_RUNS}
DECODING = [(family, k, (True, False)) for family, k in RUNS if WORKER.is_decoder(family)]
DECODING += [(family, k, (True,)) for family, k in QUICK if WORKER.is_decoder(family)]
DECODING += [(family, k, (True,)) for family, k in SEQ2SEQ_RUNS]  # greedy with the decoder blocks' caches


_TRAINED: dict = {}


def trained_on_one_device(family: str):
    """The unmodified model of ``family`` trained on one device as the worker's pipeline trains it (same AdamW,
    groups and schedule): ``(model, per-step losses, greedy continuations of the prompts)`` (``generate`` with its
    key/value cache; ``None`` for BERT). Computed once per family."""
    if family not in _TRAINED:
        model = WORKER.initial_model(family)
        model.config._attn_implementation = "eager"
        optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
        model.train()
        losses = hf_train_one_device(model, optimizer, schedule, WORKER.batches(family))
        generated = None
        if family in WORKER.SEQ2SEQ:  # greedy, with the model's generation config (as Seq2SeqLM.generate)
            prompts = WORKER.prompts()
            model.eval()
            generated = model.generate(
                prompts["input_ids"], attention_mask=prompts["attention_mask"], do_sample=False, num_beams=1,
                max_new_tokens=WORKER.MAX_NEW_TOKENS,
            )  # fmt: skip
        elif WORKER.is_decoder(family):
            model.eval()
            prompts = WORKER.prompts()
            eos = WORKER.FAMILIES[family][2]["eos_token_id"]
            model.config.output_router_logits = False  # generate's own load-balancing loss fails on its cache steps
            generated = model.generate(
                prompts["input_ids"],
                attention_mask=prompts["attention_mask"],
                do_sample=False,
                max_new_tokens=WORKER.MAX_NEW_TOKENS,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        _TRAINED[family] = (model, losses, generated)
    return _TRAINED[family]


_IN_FLOAT64: dict = {}


def trained_in_float64(family: str) -> dict:
    """The state of :func:`trained_on_one_device`'s model trained the same way in float64: the result fp32 rounding
    is measured against. Computed once per family."""
    if family not in _IN_FLOAT64:
        model = WORKER.initial_model(family).double()
        model.config._attn_implementation = "eager"
        optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
        model.train()
        hf_train_one_device(model, optimizer, schedule, WORKER.batches(family))
        _IN_FLOAT64[family] = model.state_dict()
    return _IN_FLOAT64[family]


def _merged_state(out, stages: int) -> dict:
    merged: dict = {}
    for rank in range(stages):
        merged.update(torch.load(out / f"state_rank{rank}.pt"))
    return merged


@pytest.mark.parametrize("family, stages", list(FITS))
def test_a_pipelined_fit_equals_the_model_trained_on_one_device_loss_and_every_parameter(family, stages):
    out = FITS[family, stages]()
    reference, losses, _ = trained_on_one_device(family)
    expected = reference.state_dict()
    assert_within_fp32_rounding(_merged_state(out, stages), expected, lambda: trained_in_float64(family))
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)
    for copy, source in reference.all_tied_weights_keys.items():  # every stage's copy of a tied tensor stepped alike
        for rank in range(stages):
            state = torch.load(out / f"state_rank{rank}.pt")
            if copy in state:
                torch.testing.assert_close(state[copy], expected[source], atol=1e-5, rtol=0, msg=copy)


@pytest.mark.parametrize("family, stages", list(RUNS))
def test_save_pretrained_after_a_pipelined_fit_reloads_with_from_pretrained(family, stages):
    import transformers

    out = RUNS[family, stages]()
    reloaded = getattr(transformers, WORKER.FAMILIES[family][0]).from_pretrained(out / "saved")
    for copy, source in reloaded.all_tied_weights_keys.items():
        assert reloaded.get_parameter(copy) is reloaded.get_parameter(source)
    assert_states_close(reloaded.state_dict(), _merged_state(out, stages), atol=0.0)  # exactly what the stages held
    index = json.loads((out / "saved" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == stages  # one shard per stage


@pytest.mark.parametrize("family, stages", list(SEQ2SEQ_RUNS))
def test_pipelined_beam_search_equals_generate_on_one_device(family, stages):
    """Beam search through 2 stages (each reordering its decoder blocks' caches to the kept beams, the beams of the
    second source split over the 2 micro-batches) against ``generate`` with the same beams on one device."""
    out = SEQ2SEQ_RUNS[family, stages]()
    model, _, _ = trained_on_one_device(family)
    prompts = WORKER.prompts()
    expected = model.generate(
        prompts["input_ids"], attention_mask=prompts["attention_mask"], do_sample=False, num_beams=WORKER.BEAMS,
        max_new_tokens=WORKER.MAX_NEW_TOKENS,
    )  # fmt: skip
    assert torch.equal(torch.load(out / "generated_beam.pt"), expected)


@pytest.mark.parametrize("family, stages, caches", DECODING)
def test_pipelined_greedy_generation_with_and_without_kv_cache_equals_generate_on_one_device(family, stages, caches):
    out = FITS[family, stages]()
    _, _, expected = trained_on_one_device(family)
    for cache in caches:  # each stage its blocks' key/value caches; without, the whole sequence every step
        assert torch.equal(torch.load(out / ("generated.pt" if cache else "generated_no_cache.pt")), expected), cache


@pytest.mark.parametrize("family", ["llama", "gpt2", "bert_mlm", "bert_classifier"])
def test_a_full_lightning_checkpoint_of_a_pipelined_fit_loads_without_the_strategy(family):
    import lightning_gpipe.hf as hf

    out = RUNS[family, 2]()
    module = getattr(hf, WORKER.FAMILIES[family][1]).load_from_checkpoint(out / "full.ckpt")
    reference, _, _ = trained_on_one_device(family)
    state = {k.split(".", 2)[2]: v for k, v in module.state_dict().items()}
    assert_within_fp32_rounding(state, reference.state_dict(), lambda: trained_in_float64(family))
    for copy, source in reference.all_tied_weights_keys.items():
        assert module.hf_model.get_parameter(copy) is module.hf_model.get_parameter(source)


def test_two_pipeline_replicas_of_two_stages_equal_the_model_trained_on_one_device():
    """pp 2 x dp 2: replica r reads rows r, r + 2, ... of Lightning's distributed sampler (shuffled with the seed,
    0 here); one device reads the same rows in batches of 6, in the order the sampler gives both replicas together
    (``ddp_order_loader`` of tests/models.py for this data)."""
    from torch.utils.data.distributed import DistributedSampler

    out = DATA_PARALLEL()
    rows = [{k: v[i] for k, v in batch.items()} for batch in WORKER.batches("bert_classifier") for i in range(6)]
    order = list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=0))
    batches = [{k: torch.stack([rows[j][k] for j in order[i : i + 6]]) for k in rows[0]} for i in range(0, 24, 6)]
    reference = WORKER.initial_model("bert_classifier")
    reference.config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(reference, WORKER.OPTIMIZATION, WORKER.STEPS)
    reference.train()
    hf_train_one_device(reference, optimizer, schedule, batches)
    expected = reference.state_dict()
    states = [torch.load(out / f"state_rank{rank}.pt") for rank in range(4)]
    for state in states:  # both replicas of each stage hold the one-device parameters
        assert_states_close(state, {k: expected[k] for k in state})
    assert set().union(*states) == set(expected)
    key_sets = [frozenset(state) for state in states]
    assert all(key_sets.count(keys) == 2 for keys in key_sets)  # each of the 2 stages on 2 processes


def test_a_full_checkpoint_of_2_stages_resumes_on_3_as_one_device_continues():
    """The 2-stage Llama's checkpoint at step STEPS (weights, AdamW moments, scheduler) resumed on 3 stages for
    RESUMED_STEPS more steps (the next epoch's first batches, the cosine stretched to the new last step) equals one
    device continuing the same way."""
    from lightning_gpipe.hf.module import lr_factor

    out = RESUMED()
    model = WORKER.initial_model("llama")
    model.config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
    model.train()
    hf_train_one_device(model, optimizer, schedule, WORKER.batches("llama"))
    total, options = WORKER.STEPS + WORKER.RESUMED_STEPS, WORKER.OPTIMIZATION
    stretched = lambda step: lr_factor(  # noqa: E731 - configure_optimizers on resume: over the new last step
        step, options["warmup_steps"], total, options["decay"], options["min_lr_ratio"]
    )
    schedule.lr_lambdas = [stretched] * len(optimizer.param_groups)
    losses = hf_train_one_device(model, optimizer, schedule, WORKER.batches("llama")[: WORKER.RESUMED_STEPS])
    assert_states_close(_merged_state(out, 3), model.state_dict())
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)


def _records(out, stages: int) -> list[dict]:
    return [json.loads((out / f"run_rank{rank}.json").read_text()) for rank in range(stages)]


def test_a_pipelined_bf16_mixed_fit_is_close_to_the_model_trained_on_one_device_under_autocast():
    """``precision="bf16-mixed"`` on 2 stages (Lightning's ``MixedPrecision``: CPU autocast to bf16 around each
    step's forward) against the unmodified Llama trained on one device with its forward under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, same AdamW and schedule.

    Not equal: each stage runs the blocks on micro-batches of 2 rows and accumulates their bf16 weight gradients in
    fp32, where one device rounds each gradient over all 6 rows to bf16 once, and AdamW turns small gradient
    differences into steps of about ``lr`` (1e-2) for entries whose gradient is near 0. Measured (torch 2.13 on
    x86, 4 steps): the first step's loss is equal (same parameters, same per-row bf16 forward), the later losses
    within 3e-4; over all parameters, the L2 distance from one device's bf16 parameters is 0.056, 2% of the
    distance they moved from the initial ones (2.83) and well under their distance from one device's fp32 ones
    (0.15, as far as one device's bf16 parameters are from its fp32 ones). The largest single entry differs by
    0.015 (as it does between one device's bf16 and fp32 runs: not a useful bound). So the test asserts the
    distance to bf16 at most 5% of the update (a stage whose gradients were wrong or not stepped would be far) and
    smaller than the distance to fp32 (a run in fp32 would be at 0.15 from bf16 and about 0 from fp32); the first
    loss at 1e-5 (fp32's is 6e-5 away), the others at 1e-3."""
    out = BF16()
    for record in _records(out, 2):  # every stage's blocks and the head computed in bf16
        assert record["precision_plugin"] == "MixedPrecision"
        assert record["dtypes"] and all(dtypes == ["bfloat16"] for dtypes in record["dtypes"].values()), record
    initial = WORKER.initial_model("llama").state_dict()
    one_device = {}
    for bf16 in (True, False):
        model = WORKER.initial_model("llama")
        model.config._attn_implementation = "eager"
        optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
        model.train()
        one_device[bf16] = (
            model.state_dict(),
            hf_train_one_device(model, optimizer, schedule, WORKER.batches("llama"), bf16),
        )
    (bf16_state, bf16_losses), (fp32_state, _) = one_device[True], one_device[False]
    pipelined = _merged_state(out, 2)
    assert set(pipelined) == set(bf16_state)
    to_bf16 = state_distance(pipelined, bf16_state)
    assert to_bf16 <= 0.05 * state_distance(bf16_state, initial), to_bf16
    assert to_bf16 < state_distance(pipelined, fp32_state), to_bf16
    losses = torch.tensor(torch.load(out / "losses.pt"))
    torch.testing.assert_close(losses[0], torch.tensor(bf16_losses[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(losses, torch.tensor(bf16_losses), atol=1e-3, rtol=0)


def test_balance_memory_splits_as_balance_by_memory_of_the_profiled_costs_and_equals_one_device():
    """``GPipeStrategy(balance="memory")`` on 3 stages: rank 0 profiles each GPT-2 layer's saved activations and
    parameters, every stage holds the layers ``balance_by("memory", layer_costs, 3)`` gives it, and the fit equals
    the model trained on one device."""
    from lightning_gpipe import balance_by
    from lightning_gpipe.planning.balance import LayerCost

    out = MEMORY_BALANCED()
    records = _records(out, 3)
    costs = records[0]["layer_costs"]
    assert len(costs) == 6 and all(record["layer_costs"] == costs for record in records)  # shared by rank 0
    assert all(cost["activation_bytes"] > 0 for cost in costs)
    expected = balance_by("memory", [LayerCost(**cost) for cost in costs], 3)
    assert all(record["balance_by"] == expected for record in records)
    starts = [sum(expected[:k]) for k in range(3)]
    assert [record["layers"] for record in records] == [list(range(a, a + n)) for a, n in zip(starts, expected)]
    reference, losses, _ = trained_on_one_device("gpt2")
    assert_within_fp32_rounding(_merged_state(out, 3), reference.state_dict(), lambda: trained_in_float64("gpt2"))
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- LoRA adapters (peft) on 2 stages


def _trained_lora(family: str = "llama", dtype: torch.dtype = torch.float32):
    """The worker's starting LoRA model trained on one device as the pipeline trains it (in ``dtype``): ``(model,
    losses)``."""
    model = WORKER.initial_lora(family).to(dtype)
    model.get_base_model().config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
    model.train()
    return model, hf_train_one_device(model, optimizer, schedule, WORKER.batches(family))


@pytest.mark.parametrize("family", ["llama", "t5", "mamba"])
def test_lora_on_two_stages_trains_the_adapters_as_one_device_and_leaves_the_base_weights_as_they_were(family):
    pytest.importorskip("peft")
    out = {"llama": LORA, "t5": LORA_SEQ2SEQ, "mamba": LORA_RECURRENT}[family]()
    reference, losses = _trained_lora(family)
    expected = reference.get_base_model().state_dict()
    pipelined = _merged_state(out, 2)
    assert set(pipelined) == set(expected)
    trainable = {n for n, p in reference.get_base_model().named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    if family == "llama":
        assert_states_close(pipelined, expected)  # adapters stepped alike, base weights untouched on both sides
    else:  # T5's adapters (one entry 1.2e-5 off) and Mamba's: within the rounding of fp32 (AdamW's steps near 0)
        exact = lambda: _trained_lora(family, torch.float64)[0].get_base_model().state_dict()  # noqa: E731
        assert_within_fp32_rounding(pipelined, expected, exact)
    initial = WORKER.initial_model(family).state_dict()
    for name, tensor in pipelined.items():
        if name not in trainable:
            base = name.replace(".base_layer.", ".")
            assert torch.equal(tensor, initial[base]), name
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)


def test_lora_checkpoints_hold_only_the_adapters_and_load_without_the_strategy():
    pytest.importorskip("peft")
    import lightning_gpipe.hf as hf

    out = LORA()
    reference, _ = _trained_lora()
    trainable = {n for n, p in reference.get_base_model().named_parameters() if p.requires_grad}
    checkpoint = torch.load(out / "full.ckpt", weights_only=False)
    assert {k.split(".", 2)[2] for k in checkpoint["state_dict"]} == trainable
    optimizer_names = {
        k.split(".", 1)[1].rsplit(".", 1)[0] for k in checkpoint["optimizer_states"][0] if k.startswith("state.")
    }
    assert {name.split(".", 2)[2] for name in optimizer_names} == trainable  # AdamW moments of the adapters only
    module = hf.CausalLM.load_from_checkpoint(out / "full.ckpt")  # base from `pretrained`, adapters from the file
    state = {k.split(".", 1)[1]: v for k, v in module.backbone.state_dict().items()}  # every tensor, base included
    assert_states_close(state, reference.get_base_model().state_dict())


def test_lora_save_pretrained_writes_the_adapter_directory_peft_loads():
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    out = LORA()
    reference, _ = _trained_lora()
    saved = load_file(out / "saved" / "adapter_model.safetensors")
    assert saved.keys() == peft.get_peft_model_state_dict(reference).keys()  # the adapters, nothing of the base
    loaded = peft.PeftModel.from_pretrained(WORKER.initial_model("llama"), out / "saved")
    assert_states_close(loaded.state_dict(), reference.state_dict())


def test_a_lora_checkpoint_of_2_stages_resumes_on_4_stages_as_one_device_continues():
    """The adapters-only checkpoint (adapters, their AdamW moments, the scheduler) resumed on 4 stages, whose last
    holds only frozen layers and so an optimizer over nothing, for RESUMED_STEPS more steps: one device's LoRA model
    going on the same way (the base read from ``pretrained`` again)."""
    pytest.importorskip("peft")
    from lightning_gpipe.hf.module import lr_factor

    out = LORA_RESUMED()
    states = [torch.load(out / f"state_rank{rank}.pt") for rank in range(4)]
    assert not any(".lora_" in name for name in states[3])  # nothing to train on the last stage
    model = WORKER.initial_lora("llama")
    model.get_base_model().config._attn_implementation = "eager"
    optimizer, schedule = hf_one_device_optimizer(model, WORKER.OPTIMIZATION, WORKER.STEPS)
    model.train()
    hf_train_one_device(model, optimizer, schedule, WORKER.batches("llama"))
    total, options = WORKER.STEPS + WORKER.RESUMED_STEPS, WORKER.OPTIMIZATION
    stretched = lambda step: lr_factor(  # noqa: E731 - configure_optimizers on resume: over the new last step
        step, options["warmup_steps"], total, options["decay"], options["min_lr_ratio"]
    )
    schedule.lr_lambdas = [stretched] * len(optimizer.param_groups)
    losses = hf_train_one_device(model, optimizer, schedule, WORKER.batches("llama")[: WORKER.RESUMED_STEPS])
    assert_states_close(_merged_state(out, 4), model.get_base_model().state_dict())
    torch.testing.assert_close(torch.tensor(torch.load(out / "losses.pt")), torch.tensor(losses), atol=1e-5, rtol=0)
