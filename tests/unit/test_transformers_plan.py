"""The declared pipeline plan first (lightning_gpipe.hf.adapter.declared_cut, transformers PR #36091): a causal LM
whose config declares ``base_model_pp_plan`` is cut at the modules the plan names (GPT-NeoX's and Phi's names too),
structure the fallback, the self-check always, a disagreement named; and benchmarks/hf_conformance.py's verdict on a
representative few of the installed transformers' declaring classes (the whole sweep is that benchmark). Built from
small configs."""

import pytest
import torch
from grid import FULL
from hf_families import conformance

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_gpipe.hf import CausalLM, SelfCheckError, UnsupportedModelError, family_of, to_sequential  # noqa: E402

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64)  # fmt: skip


def _meta(model_type: str, **fields):
    config = AutoConfig.for_model(model_type, **{**TINY, **fields})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    "model_type, paths",
    [
        ("gpt_neox", [["gpt_neox.embed_in", "gpt_neox.emb_dropout"], ["gpt_neox.layers.0", "gpt_neox.rotary_emb"],
                      ["gpt_neox.final_layer_norm"], ["lm_head"]]),
        ("phi", [["model.embed_tokens", "model.embed_dropout"], ["model.layers.0", "model.rotary_emb"],
                 ["model.final_layernorm"], ["lm_head"]]),
        ("codegen", [["transformer.wte", "transformer.drop"], ["transformer.h.0", "transformer.rotary_emb"],
                     ["transformer.ln_f"], ["lm_head"]]),
    ],
)  # fmt: skip
def test_a_declared_plan_cuts_the_model_at_the_modules_it_names(model_type, paths):
    """GPT-NeoX (Pythia), Phi 1/2 and CodeGen, refused by structure before, cut where their plans say: the
    embedding and the module the plan puts on it, one layer per block (with the rotary embedding the plan leaves
    out), the final norm the plan names, the head."""
    model = _meta(model_type, num_key_value_heads=4) if model_type == "phi" else _meta(model_type)
    assert family_of(model).name == "declared plan"
    backbone = to_sequential(model, check=False)
    layers = [list(layer.paths) for layer in backbone]
    assert len(layers) == 6 and [layers[0], layers[1], layers[-2], layers[-1]] == paths


@pytest.mark.parametrize(
    "model_type",
    ["gpt_neox", "phi", "codegen", "qwen3_next", "minicpm3", "llama"]
    + ["longcat_flash", "phi4_multimodal", "granite_swa", "glm_moe_dsa", "dots3_note_text", "gemma4_text"]
    + ["gemma4_unified_text", "inkling_text", "hy_v4", "deepseek_v4", "beam"],
)
def test_declaring_classes_of_the_installed_transformers_equal_their_own_forward(model_type):
    """benchmarks/hf_conformance.py on a few: a plan with other names (GPT-NeoX, Phi, CodeGen), linear-attention
    layers (Qwen3-Next), the hidden states scaled before the head (MiniCPM3), the standard layout (Llama); and one of
    each mechanism taken since: blocks of two attention sublayers (LongCat-Flash), a multimodal feature embedding
    on the embeddings (Phi-4-multimodal), a rotary module per layer theta (Granite-SWA), a value carried from block
    to block (GLM-MoE-DSA's top-k indices), per-layer config overrides shrunk (Dots3-Note), per-layer embeddings
    (Gemma 4), image-only bidirectional attention (Gemma 4 Unified), hybrid layers taking two masks (Inkling),
    hyper-connection streams (HY-V4), the token ids and every kind of rotary table given to every block (DeepSeek-V4's
    hash-routed experts; `main` and `compress`), layers without rotary parameters given what their modeling module
    computes (Beam): logits, loss and every gradient of the backbone layer by layer within 1e-5 of the class's own
    forward."""
    result = conformance().conform(model_type)
    assert (result.verdict, result.family) == ("equal", "declared plan"), result.detail


def _equal_to_forward(model) -> None:
    """The backbone of ``model`` (checked) layer by layer equals its forward: logits, loss (shifted or not, as the
    class's forward computes it), every gradient."""
    from lightning_gpipe.hf.decoder import causal_lm_loss, shifts_labels
    from lightning_gpipe.hf.packing import decoder_input

    ids = torch.randint(3, 61, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    model.eval()
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    value = decoder_input(ids, mask)
    for layer in to_sequential(model):
        value = layer(value)
    loss = causal_lm_loss(value, labels, None, shift=shifts_labels(type(model)))
    torch.testing.assert_close(value[mask.bool()], expected.logits[mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=0)
    loss.backward()
    assert grads and grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, parameter in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(parameter.grad, grads[name], atol=1e-5, rtol=0, msg=name)


def test_blocks_of_two_attention_sublayers_are_one_layer_each():
    """LongCat-Flash's `layers` holds num_hidden_layers / 2 blocks of two attention sublayers each: one backbone
    layer per block, its first sublayer's index its layer index."""
    config = AutoConfig.for_model("longcat_flash", **{**TINY, "num_hidden_layers": 4}, num_key_value_heads=4,
                                  q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                  v_head_dim=8, head_dim=4, n_routed_experts=4, moe_topk=2,
                                  expert_ffn_hidden_size=16, ffn_hidden_size=48)  # fmt: skip
    assert (config.num_layers, config.num_hidden_layers) == (2, 4)
    torch.manual_seed(0)
    model = transformers.LongcatFlashForCausalLM(config)
    backbone = to_sequential(model)
    assert [layer.layer_index for layer in backbone[1:3]] == [0, 2]
    _equal_to_forward(model)


def test_a_value_one_block_gives_the_next_is_carried_between_their_layers():
    """GLM-MoE-DSA's `shared` layers reuse the top-k indices the previous `full` layer's indexer chose: the block
    returns them and the next block's layer gives them back as `prev_topk_indices`."""
    config = AutoConfig.for_model("glm_moe_dsa", **TINY, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
                                  qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=16, index_topk=4,
                                  index_head_dim=8, index_n_heads=2,
                                  indexer_types=["full", "shared", "shared"])  # fmt: skip
    torch.manual_seed(0)
    _equal_to_forward(transformers.GlmMoeDsaForCausalLM(config))


def test_a_rotary_module_per_layer_theta_and_layers_without_rotary():
    """Granite-SWA builds one rotary module per non-zero `layer_rope_theta` (0: no rotary embedding): each block's
    layer calls its own theta's."""
    config = AutoConfig.for_model("granite_swa", **TINY, layer_rope_theta=[1e4, 0, 5e5],
                                  layer_types=["sliding_attention", "full_attention", "full_attention"],
                                  sliding_window=4)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GraniteSWAForCausalLM(config)
    assert [list(layer.paths) for layer in to_sequential(model)[1:4]] == [
        ["model.layers.0", "model.rotary_embs.0", "model.rotary_emb"],
        ["model.layers.1", "model.rotary_emb"],
        ["model.layers.2", "model.rotary_embs.1", "model.rotary_emb"],
    ]
    _equal_to_forward(model)


def test_layers_reusing_earlier_layers_keys_and_values_read_them_across_layers_and_decode_as_generate_does():
    """Gemma 4 with `num_kv_shared_layers`, refused before: the layers that store keys and values (one per layer type)
    add them to the value, the last layers read them from it, so the backbone equals the model's forward (every
    gradient too: the reusing layers' flow back into the storing layers' projections); greedy decoding, with caches (a
    reusing layer's mask built against the storing layer's cache, mirrored in its own) and without, equals `generate`.
    Without `kv_sharing_modes` to say which layer stores what, it stays refused."""
    from lightning_gpipe.hf.decoder_layout import kv_sharing_reason

    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma4_text", **{**TINY, "num_hidden_layers": 4}, num_kv_shared_layers=2,
                                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=61,
                                  layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    _equal_to_forward(model)
    _decodes_as_generate(model, kv_caches=(True, False))
    assert "kv_sharing_modes" in str(kv_sharing_reason(LlamaConfig(num_kv_shared_layers=2)))


def test_alternating_updates_travel_as_a_stack_and_are_narrowed_before_the_norm():
    """Gemma 3n, refused before (its base model holds `altup_projections` and `altup_unembed_projections`): the
    embedding layer widens the embeddings into AltUp's predictions, which travel as (N, S, n, H) and each block takes
    as (n, N, S, H), the final norm's layer narrows them; with its last 2 layers reusing keys and values and its
    per-layer inputs, the backbone equals its forward (logits, loss, every gradient) and decodes as `generate` (its
    sliding window of 3 crossed), with caches and without. (benchmarks/hf_conformance.py checks its default config's
    miniature.)"""
    torch.manual_seed(0)
    fields = {**SMALL["gemma3n_text"], "num_hidden_layers": 4, "num_kv_shared_layers": 2}
    fields.update(
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0]
    )
    model = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3n_text", **fields))
    backbone = to_sequential(model, check=False)
    assert (
        backbone[0].paths[-1] == "model.altup_projections"
        and backbone[-2].paths[0] == "model.altup_unembed_projections"
    )
    _equal_to_forward(model)
    _decodes_as_generate(model, kv_caches=(True, False))


def test_the_conformance_comparison_can_find_a_difference():
    """The sweep's own comparison (not the self-check) sees a class whose forward differs from its cut."""

    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    tensor, difference = conformance().compare(DoubledLogits, LlamaConfig(**TINY))
    assert tensor == "logits" and difference > 1e-5


class _ScaledLogitsLlama(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 2
        return output


def test_a_self_check_failure_names_the_plan_the_structure_and_the_forward():
    with pytest.raises(SelfCheckError) as refused:
        to_sequential(_ScaledLogitsLlama(LlamaConfig(**TINY)))
    message = str(refused.value)
    assert "backbone layer 4 (lm_head) differs from the model's own forward" in message
    plan = "cut where its declared pipeline plan says (model.embed_tokens -> model.layers.* -> model.norm -> lm_head"
    assert plan in message and "the cut by structure: the same" in message


class _NoPlanConfig(LlamaConfig):
    base_model_pp_plan = None


class _ElsewhereConfig(LlamaConfig):
    """Declares the rotary embedding as a module on the embeddings, which the standard layout holds apart."""

    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "rotary_emb": (["inputs_embeds"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }


def test_a_class_without_a_plan_is_cut_by_structure_and_says_so():
    model = LlamaForCausalLM(_NoPlanConfig(**TINY))
    family = family_of(model)
    assert family.name == "decoder"
    assert "not where a declared plan says: it declares no pipeline plan" in family.describe(model)
    assert len(to_sequential(model)) == 6


def test_a_plan_and_a_structure_that_cut_a_model_differently_are_an_error_naming_both():
    with pytest.raises(UnsupportedModelError) as refused:
        to_sequential(LlamaForCausalLM(_ElsewhereConfig(**TINY)), check=False)
    message = str(refused.value)
    assert "declared pipeline plan and its structure disagree" in message
    assert "model.embed_tokens -> model.rotary_emb -> model.layers.* -> model.norm -> lm_head" in message
    assert "the standard layout as model.embed_tokens -> model.layers.* -> model.norm -> lm_head" in message


def test_a_plan_naming_modules_the_model_lacks_is_refused_naming_them():
    """HRM's text model declares Llama's plan, but holds its blocks in `H_module` and `L_module`."""
    model = _meta("hrm_text")
    with pytest.raises(UnsupportedModelError, match=r"its plan names \['model.layers', 'model.norm'\], which"):
        to_sequential(model, check=False)


def test_modules_the_plan_leaves_out_are_held_where_the_forward_uses_them():
    """Phi-4-multimodal: `embed_tokens_extend` (image and audio features merged into the embeddings; for text, the
    embeddings unchanged) is applied in the embedding layer, and `embed_dropout`, which its forward never calls and
    which holds no tensor, is held by none; HY-V4's `hc_head` collapses the hyper-connection streams in the final norm's
    layer."""
    phi = _meta("phi4_multimodal", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    assert family_of(phi).name == "declared plan"
    layers = [list(layer.paths) for layer in to_sequential(phi, check=False)]
    assert layers[0] == ["model.embed_tokens", "model.embed_tokens_extend"]
    assert not any("model.embed_dropout" in paths for paths in layers)
    latent = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                  v_head_dim=8, head_dim=4)  # fmt: skip
    hy = _meta("hy_v4", **latent, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    assert list(to_sequential(hy, check=False)[-2].paths) == ["model.hc_head", "model.norm"]


GPT2_LIKE = {
    "falcon-multi-query": dict(multi_query=True, parallel_attn=True),
    "falcon-new-architecture": dict(new_decoder_architecture=True, num_kv_heads=2),
    "falcon-alibi": dict(alibi=True, multi_query=True, parallel_attn=True),
    "mpt": dict(n_heads=4, d_model=32, max_seq_len=64),
    "gpt_bigcode": dict(n_embd=32, n_head=4, n_positions=64),
    "xglm": dict(d_model=32, attention_heads=4, ffn_dim=48),
}
"""The GPT-2-like decoders that declare no plan, as small configs (Bloom's ALiBi: tests/hf_families.py): rotary with
multi-query and parallel attention, or the new architecture's grouped heads, or ALiBi folded into the mask (Falcon),
ALiBi over max_seq_len with a boolean mask (MPT), multi-query attention with learned positions (GPT-BigCode),
sinusoidal positions and its own dropout (XGLM)."""


def _gpt2_like(name: str, **fields):
    torch.manual_seed(0)
    config = AutoConfig.for_model(name.split("-")[0], **{**TINY, **GPT2_LIKE[name], **fields})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(GPT2_LIKE))
def test_gpt2_like_decoders_without_a_plan_equal_their_forward_and_decode_as_generate_does(name):
    """Falcon, MPT, GPT-BigCode and XGLM (and Bloom, in tests/hf_families.py), refused before: cut by structure
    (token embedding, a position embedding or a module on the embeddings, `transformer.h`-style blocks given what
    their forward computes, final norm, head), the self-check passing; logits, loss and every gradient equal the
    model's forward; greedy decoding of left-padded prompts with each block's own cache equals ``generate``'s tokens
    (MPT's position bias over the cached positions, Falcon's rotary, GPT-BigCode's multi-query cache)."""
    model = _gpt2_like(name)
    assert family_of(model).name == "gpt2-like"
    _equal_to_forward(model)
    _decodes_as_generate(model)


def _decodes_as_generate(model, kv_caches: tuple[bool, ...] = (True,), wrap=None) -> None:
    """Greedy decoding of left-padded prompts through ``model``'s backbone (given to ``wrap`` where one is), each
    block keeping its own cache (and without caches where ``kv_caches`` holds ``False``), equals ``generate``'s
    tokens."""
    from lightning_gpipe.hf import greedy_generate

    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [8, 9, 10, 11, 12, 13]])
    mask = (ids != 0).long()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=5, pad_token_id=2,
                              eos_token_id=2)  # fmt: skip
    backbone = to_sequential(model, check=False)
    backbone = backbone if wrap is None else wrap(backbone)
    for kv_cache in kv_caches:
        generated = greedy_generate(backbone, ids, mask, max_new_tokens=5, eos_token_id=2, kv_cache=kv_cache)
        assert torch.equal(generated, expected), kv_cache


def test_a_gpt2_like_decoder_its_forward_changes_is_refused_naming_why():
    """XGLM's layer drop stays refused, naming the option."""
    with pytest.raises(UnsupportedModelError, match="layerdrop=0.1: its forward skips layers at random"):
        to_sequential(_gpt2_like("xglm", layerdrop=0.1), check=False)


RECURRENT = {
    "mamba2": dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=4),
    "falcon_mamba": dict(state_size=8),
    "bamba": dict(num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                  mamba_chunk_size=4),
    "lfm2": dict(num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"], block_auto_adjust_ff_dim=False),
    "nemotron_h": dict(layer_types=["linear_attention", "moe", "full_attention", "mlp"], num_key_value_heads=2,
                       mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=4,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1),
    "falcon_h1": dict(num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=4, lm_head_multiplier=0.5, embedding_multiplier=2.0),
    "zamba": dict(layers_block_type=["hybrid", "linear_attention", "hybrid"], n_mamba_heads=2, mamba_d_state=8,
                  num_key_value_heads=2),
    "zamba2": dict(layers_block_type=["hybrid", "linear_attention", "hybrid"], n_mamba_heads=4, mamba_d_state=8,
                   chunk_size=4, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True),
}  # fmt: skip
"""The recurrent and hybrid decoders without a plan besides Mamba and Jamba (tests/hf_families.py), as small configs:
Mamba-2's multi-head selective scan in chunks of 4 tokens (the probe's 11 cross chunks), Falcon-Mamba's normalised
time step, B and C, Bamba's Mamba-2 layers around an attention layer with rotary positions, LFM2's short convolutions
(``conv`` layers) around an attention layer, Nemotron-H's Mamba-2, attention and feed-forward blocks (``moe``,
``mlp``: no mask, no cache), Falcon-H1's ``hybrid`` blocks (a Mamba-2 mixer beside attention, each given its mask; its
multipliers on the embeddings and the logits), Zamba's and Zamba2's Mamba layers, two of them hybrid: one attention
block shared by both (tied), reading the embeddings beside the hidden states (Zamba2's with per-layer adapters and
rotary positions)."""


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_decoders_without_a_plan_equal_their_forward_and_decode_as_generate_does(name):
    """Refused before ("its blocks carry a state"): cut by the GPT-2-like layout, the self-check passing, every row's
    state starting at zero as in the model's forward; logits, loss and every gradient equal the model's forward (a
    left-padded row, whose padding the mixers zero); greedy decoding of left-padded prompts, each block keeping its
    convolution and recurrent states (an attention layer its keys and values) in its own cache, equals ``generate``."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **{**TINY, **RECURRENT[name]})
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert family_of(model).name == "gpt2-like"
    _equal_to_forward(model)
    _decodes_as_generate(model)


@pytest.mark.parametrize("model_type", ["lfm2_moe", "lfm3"])
def test_recurrent_decoders_of_other_rotary_embeddings_equal_their_own_forward(model_type):
    """benchmarks/hf_conformance.py on LFM2-MoE (refused before: its rotary embedding is named `pos_emb`; its experts
    after a dense layer) and LFM3 (refused before: a rotary table per layer type, none for its `conv` layers): cut by
    the GPT-2-like layout; logits, loss and every gradient within 1e-5 of the class's own forward."""
    result = conformance().conform(model_type)
    assert (result.verdict, result.family) == ("equal", "gpt2-like"), result.detail


DECODER_STACKS = {
    "bart": dict(vocab_size=61, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48,
                 max_position_embeddings=64, scale_embedding=True, forced_eos_token_id=None),
    "opt": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                word_embed_proj_dim=16, max_position_embeddings=64),
    "gpt_neox_japanese": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_multiple_size=2, max_position_embeddings=64),
}  # fmt: skip
"""A causal LM of each decoder-stack structure, as small configs: a wrapper's decoder stack (BART's: learned positions
over the padding too, a norm on the embeddings registered after the blocks, cross-attention left unused, a loss on
unshifted labels; no end of sequence forced in `generate`), a stack applying modules after its final norm (OPT's
``project_in`` and ``project_out`` at a width of 16), a stack that is the base model with a rotary embedding and a
head of another name (GPT-NeoX-Japanese's ``embed_out``)."""


@pytest.mark.parametrize("name", [name for name in DECODER_STACKS if FULL or name != "gpt_neox_japanese"])
def test_decoder_stacks_equal_their_forward_and_decode_as_generate_does(name):
    """Refused before by structure: cut as one decoder stack (its own forward up to the first block for the
    embeddings, the blocks, what its forward applies after them, the head), the self-check passing; logits, loss and
    every gradient equal the model's forward; greedy decoding of left-padded prompts with each block's own cache
    equals ``generate``'s tokens (the new tokens numbered after the cached ones by the stack itself)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **DECODER_STACKS[name]))
    assert family_of(model).name == "decoder stack"
    _equal_to_forward(model)
    _decodes_as_generate(model)


def test_labels_equal_to_the_inputs_of_a_class_scoring_unshifted_labels_are_refused():
    """BART's causal LM scores each position against its own label: labels equal to the input ids (as every other
    causal LM takes them) would train it to copy its input, and are refused on the first batch, naming the labels to
    give; those labels pass."""
    ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    for labels, refused in ((ids.masked_fill(ids < 9, -100), True), (shifted, False)):
        module = CausalLM(config=AutoConfig.for_model("bart", **DECODER_STACKS["bart"]))
        module.configure_model()
        if refused:
            with pytest.raises(ValueError, match=r"labels\[:, i\] = input_ids\[:, i \+ 1\]"):
                module.backbone_input({**batch, "labels": labels})
        else:
            module.backbone_input({**batch, "labels": labels})


def test_a_decoder_stack_its_forward_changes_is_refused_naming_why():
    """A stack whose forward skips layers at random (LayerDrop) stays refused, naming why; MVP's causal LM, whose
    decoder is built without prompts whatever ``use_prompt`` says (its blocks' prompts stay ``None``), is taken;
    packed rows are refused at the embeddings."""
    with pytest.raises(UnsupportedModelError, match="layerdrop=0.5: its forward skips layers at random"):
        to_sequential(transformers.AutoModelForCausalLM.from_config(
            AutoConfig.for_model("bart", **DECODER_STACKS["bart"], decoder_layerdrop=0.5)), check=False)  # fmt: skip
    mvp = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model("mvp", **DECODER_STACKS["bart"]))
    assert family_of(mvp).name == "decoder stack"
    from lightning_gpipe.hf.packing import decoder_input

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model("opt", **DECODER_STACKS["opt"]))
    ids = torch.randint(3, 61, (1, 6))
    packed = decoder_input(ids, None, torch.tensor([[0, 1, 2, 0, 1, 2]]))
    with pytest.raises(ValueError, match="numbers the positions of a whole row itself"):
        to_sequential(model, check=False)[0](packed)


BERT_STACK = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=64, is_decoder=True)  # fmt: skip
CAUSAL_ENCODERS = {
    "bert": {},
    "roberta": {},
    "electra": dict(embedding_size=16),
    "roformer": dict(embedding_size=16, rotary_value=True),
}
"""BERT-style causal-LM heads with ``is_decoder=True``, as small configs: BERT's (word, position and token-type
embeddings; its ``cls`` head tied to the word embedding; its forward numbers a left-padded row's positions from the
row's start, ``generate`` from its first real token), RoBERTa's (its forward numbers positions from its padding id
up, ``generate`` from 0), ELECTRA's (a projection of narrower embeddings, a head of two modules), RoFormer's (rotary
``sinusoidal_pos`` its encoder computes for every block, on the values too; its forward takes no positions)."""


@pytest.mark.parametrize("name", [name for name in CAUSAL_ENCODERS if FULL or name != "electra"])
def test_bert_style_causal_lm_heads_with_is_decoder_equal_their_forward_and_decode_as_generate_does(name):
    """Refused before (cut as encoders, or no layout): with ``is_decoder=True`` cut as a causal encoder (the base
    model's forward up to its first block, the blocks with the causal mask, the head), the self-check passing;
    logits, loss and every gradient equal the model's forward (positions numbered as it numbers them); greedy
    decoding of left-padded prompts, with each block's own cache and without caches, equals ``generate``'s tokens
    (positions numbered as ``generate`` numbers them, which differ)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(name, **BERT_STACK, **CAUSAL_ENCODERS[name])
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert family_of(model).name == "causal encoder"
    _equal_to_forward(model)
    _decodes_as_generate(model, (True, False))


def test_a_bert_style_causal_lm_head_that_is_no_causal_lm_is_refused_naming_the_fix():
    """Without ``is_decoder=True`` (a bidirectional encoder) ``CausalLM`` refuses it, naming ``is_decoder=True``;
    with cross-attention (a decoder of an encoder-decoder) and BigBird's block-sparse attention (bidirectional) it
    is refused by structure, naming why."""
    bert = {"model_type": "bert", **{k: v for k, v in BERT_STACK.items() if k != "is_decoder"}}
    with pytest.raises(UnsupportedModelError, match=r"set `is_decoder=True` in its config \(overrides="):
        CausalLM(config=bert)
    electra = AutoConfig.for_model("electra", **BERT_STACK, add_cross_attention=True)
    with pytest.raises(UnsupportedModelError, match="add_cross_attention=True: its blocks attend to an encoder's"):
        to_sequential(transformers.AutoModelForCausalLM.from_config(electra), check=False)
    big_bird = AutoConfig.for_model("big_bird", **BERT_STACK, attention_type="block_sparse")
    with pytest.raises(UnsupportedModelError, match="attention_type='block_sparse': block-sparse attention"):
        to_sequential(transformers.AutoModelForCausalLM.from_config(big_bird), check=False)


@pytest.mark.parametrize(
    "model_type, family",
    [("nanochat", "decoder"), ("granitemoe_swa", "decoder"), ("dbrx", "gpt2-like"),
     ("modernbert-decoder", "decoder stack"), ("lara_mini", "declared plan")],
)  # fmt: skip
def test_decoders_of_structures_taken_since_equal_their_own_forward(model_type, family):
    """benchmarks/hf_conformance.py on one class of each structure taken since (issue 58), each refused before: a final
    norm its forward applies to the embeddings too (NanoChat: the self-check compares what the norm receives after the
    blocks, not its first call), rotary modules per layer theta beside the standard layout (Granite-MoE-SWA), a
    config nested in the model's of the model's width (DBRX's ``ffn_config``, which the miniature shrinks with it),
    a prediction head between the decoder stack and the output head (ModernBERT-decoder), rotary tables its forward
    gives one layer type only (Lara-mini: none for its full-attention layers): logits, loss and every gradient of the
    backbone layer by layer within 1e-5 of the class's own forward."""
    result = conformance().conform(model_type)
    assert (result.verdict, result.family) == ("equal", family), result.detail


def test_a_decoder_running_its_blocks_in_several_loops_is_refused_naming_it():
    """Dory runs an input section of its blocks, a recurrent section twice with the section's input added back, then
    an output section: no one pass through the blocks follows it, so every layout refuses it by structure, naming the
    loops (before, the self-check refused it at its final norm, naming no structure)."""
    result = conformance().conform("dory")
    assert result.verdict == "refused"
    assert "not the decoder layout: its forward runs its blocks in 3 loops one after the other" in result.detail


def test_blocks_the_forward_skips_on_text_are_held_and_passed_over():
    """Mllama's text model skips its cross-attention layers where it is given no image (``if ... cross_attention_states
    is None ...: continue``) and passes its image arguments on to its blocks as given, ``None`` on text: its
    self-attention blocks are called without them, a cross-attention block (which requires them) is a layer holding it
    that passes the value on; the miniature keeps one (its ``cross_attention_layers`` renumbered), logits, loss and
    every gradient equal the class's own forward (neither side gives the skipped block a gradient), and greedy
    decoding with each block's own cache equals ``generate``'s tokens."""
    from lightning_gpipe.hf.decoder import SkippedBlock
    from lightning_gpipe.hf.selfcheck import miniature, miniature_config

    config = AutoConfig.for_model("mllama").get_text_config()
    assert miniature_config(config).cross_attention_layers == [1]
    model = miniature(transformers.MllamaForCausalLM, config).eval()
    backbone = to_sequential(model, check=False)
    assert [type(layer).__name__ for layer in backbone[1:3]] == ["RotaryDecoderBlock", "SkippedBlock"]
    assert isinstance(backbone[2], SkippedBlock) and backbone[2].paths == ("model.layers.1",)
    result = conformance().conform("mllama")
    assert (result.verdict, result.family) == ("equal", "decoder"), result.detail
    _decodes_as_generate(model)


SMALL = {
    "rwkv": dict(vocab_size=61, hidden_size=32, num_hidden_layers=3, attention_hidden_size=32, intermediate_size=48,
                 context_length=64, rescale_every=2, use_cache=False),
    "ctrl": dict(vocab_size=61, n_embd=32, n_layer=2, n_head=4, dff=48, n_positions=64),
    "moshi": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=48, max_position_embeddings=64, sliding_window=3),
    "falcon_h1": dict(TINY, **RECURRENT["falcon_h1"]),
    "gemma3n_text": dict(TINY, vocab_size_per_layer_input=61, hidden_size_per_layer_input=8, num_hidden_layers=2,
                         num_key_value_heads=2, head_dim=8, laurel_rank=4, num_kv_shared_layers=0, sliding_window=3,
                         layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.95, 0.0]),
    "openai-gpt": dict(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.3),
    "zaya": dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=8, moe_intermediate_size=16, num_experts=4, router_hidden_size=16, max_position_embeddings=64,
                 layer_types=["hybrid", "hybrid_sliding"], sliding_window=4, initializer_range=0.3),
    "recurrent_gemma": dict(TINY, num_key_value_heads=2, head_dim=8, lru_width=32, attention_window_size=4),
}  # fmt: skip
"""Small configs of the layouts taken by the blocks' own names and state (RWKV, rescaling every 2 blocks in
evaluation), a stack's unsaved buffer (CTRL's sinusoidal table; RecurrentGemma's `normalizer`, with two recurrent
blocks and a sliding-window attention block of window 4), a sliding window the forward ignores (Moshi), a stack
building its mask itself (OpenAI GPT), a stack's own parameters, hybrid masks in one dict and router states carried
from block to block (Zaya: a full and a sliding-window layer); weights drawn wide enough that greedy decoding varies."""


def _small(name: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **SMALL[name]))


def test_blocks_with_a_state_argument_equal_their_forward_and_refuse_cached_decoding():
    """RWKV, refused before (its head is `head`, its blocks take `hidden` and `state`): cut by the GPT-2-like layout,
    its state fresh per sequence (`None`, as its forward gives it in training), equal to its forward in evaluation
    after its own forward rescaled its weights (the hidden states halved after every `rescale_every`-th block, as its
    forward halves them); cached decoding through the pipeline, which would not keep that state, is refused loudly.
    xLSTM (its miniature's `num_blocks` mirroring the depth, its logits soft-capped by `output_logit_soft_cap`) by the
    conformance benchmark."""
    from lightning_gpipe.hf import greedy_generate

    model = _small("rwkv")
    assert family_of(model).name == "gpt2-like"
    _equal_to_forward(model)  # its eval forward rescales the weights first: the layers halve where it halves
    assert model.rwkv.layers_are_rescaled
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match=r"keeps its recurrent state in an argument of its own \(\['state'\]\)"):
        greedy_generate(to_sequential(model, check=False), ids, torch.ones_like(ids), max_new_tokens=2)
    result = conformance().conform("xlstm")
    assert (result.verdict, result.family) == ("equal", "gpt2-like"), result.detail


class _RowByRow(torch.nn.Module):
    """A backbone run on each row of the value alone, one after the other, as a stage runs a decoding step's
    micro-batches through its layers."""

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, value):
        return torch.cat([self.backbone(tuple(item[row : row + 1] for item in value)) for row in range(len(value[0]))])


def test_blocks_keeping_their_state_on_their_modules_equal_their_forward_and_decode_as_generate_does():
    """RecurrentGemma, refused before (its stack reads its unsaved `normalizer`; its `linear_attention` layers carry
    a state): cut as a decoder stack, its recurrent blocks told `use_cache=False` so that their state, which they keep
    on their modules (`_setup_cache`), starts fresh per sequence as in the model's forward; its logits soft-capped
    (`logits_soft_cap`). Equal to its forward; greedy decoding of left-padded prompts equals `generate` with and
    without caches, and with the rows run one at a time through the same modules (a pipeline's micro-batches), each
    block giving each row its own state."""
    model = _small("recurrent_gemma")
    assert family_of(model).name == "decoder stack"
    _equal_to_forward(model)
    _decodes_as_generate(model, kv_caches=(True, False))
    _decodes_as_generate(model, wrap=_RowByRow)


@pytest.mark.parametrize("name", ["ctrl", "moshi"])
def test_stack_buffers_and_ignored_options_equal_their_forward_and_decode_as_generate_does(name):
    """CTRL, refused before (its blocks take `x`; its stack reads a sinusoidal table it holds unsaved): cut as a
    decoder stack whose embedding holds that buffer and runs the stack's forward (the scaled embeddings, the table),
    the positions generate gives when decoding; Moshi, refused before (its blocks take `codebook_idx`, which its forward
    never gives them): the GPT-2-like layout, the causal mask its forward builds (not the sliding window its config
    names and nothing reads). Equal to their forward; greedy decoding equals `generate`."""
    model = _small(name)
    assert family_of(model).name == ("decoder stack" if name == "ctrl" else "gpt2-like")
    _equal_to_forward(model)
    _decodes_as_generate(model)


@pytest.mark.parametrize("name", ["openai-gpt", "zaya"])
def test_stacks_building_their_own_masks_and_carrying_router_states_equal_their_forward(name):
    """OpenAI GPT, refused before by the self-check (its loss): its stack's forward builds no mask with
    ``masking_utils`` but gives its blocks the padding mask alone, inverted (their attention masks the future with
    its own ``bias``), which decides what a left-padded row's padding attends to, and so the logits at its last
    padding, scored against the first real token; its blocks take no cache, so cached decoding is refused, naming
    ``kv_cache=False``, which equals ``generate`` (the positions it gives). Zaya, refused before (its hybrid masks in
    one dict; its base model's own input scale and bias): a decoder stack whose embedding holds and lends those
    parameters and runs its forward, blocks given ``{"causal": ..., "conv": ...}`` and the router states the previous
    block gave. Equal to their forward; greedy decoding equals ``generate``."""
    from lightning_gpipe.hf import greedy_generate

    model = _small(name)
    assert family_of(model).name == "decoder stack"
    _equal_to_forward(model)
    _decodes_as_generate(model, (False,) if name == "openai-gpt" else (True, False))
    if name == "openai-gpt":
        ids = torch.tensor([[5, 6, 7]])
        with pytest.raises(ValueError, match=r"Block takes no cache .* with kv_cache=False"):
            greedy_generate(to_sequential(model, check=False), ids, torch.ones_like(ids), max_new_tokens=2)


@pytest.mark.parametrize("name", ["ctrl", "falcon_h1", "gemma3n_text", "zaya", "recurrent_gemma"])
def test_buffers_the_model_sets_itself_are_set_on_a_stage_that_builds_only_its_layers(name):
    """Built on the meta device and materialised layer by layer as stages do, with the model's weights loaded: the
    buffers the model computes at its own initialisation and does not save are set again (CTRL's table and
    RecurrentGemma's `normalizer`, which the embedding layer holds and lends its stack; Falcon-H1's `mup_vector`,
    which its base model sets in each mixer; Gemma 3n's per-layer scales, which its base model holds and its per-layer
    methods read, held and lent by the embedding layer), and a stack's own parameters are initialised as the model
    initialises them and then loaded (Zaya's input scale, held by the embedding layer), so the layers equal the
    model's forward."""
    from lightning_gpipe.engine import materialize
    from lightning_gpipe.hf.packing import decoder_input

    real = _small(name).eval()
    config = AutoConfig.for_model(name, **SMALL[name])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    value = decoder_input(torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]))
    for layer in to_sequential(model.eval(), check=False):
        materialize(layer, torch.device("cpu"))
        if name == "zaya" and "model.input_hidden_states_scale" in layer.state_dict():
            assert torch.equal(layer.state_dict()["model.input_hidden_states_scale"], torch.ones(32))
        layer.load_state_dict({name: real.state_dict()[name] for name in layer.state_dict()})
        value = layer(value)
    torch.testing.assert_close(value, real(input_ids=torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])).logits)


QWEN4_EXP = dict(TINY, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, layer_types=["linear_attention",
                 "indexed_attention"], linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                 linear_num_value_heads=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                 num_experts_per_tok=2, hc_count=2, hc_lowrank=8, ple_layer_ids=[1], ple_embed_dim=16,
                 heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, eos_token_id=2,
                 indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                 indexer_compress_ratio=2)  # fmt: skip
"""A small Qwen4-Exp: a linear-attention block with per-layer n-gram embeddings (PLE), an indexed-attention one."""


def test_flat_hyper_connection_streams_per_layer_token_ids_and_both_masks_equal_their_forward():
    """Qwen4-Exp, refused before: its embeddings repeated into 2 flat hyper-connection streams ``(N, S, 2 * H)``
    (``repeat(1, 1, config.hc_count)``) and collapsed after the blocks by ``hyper_connection_mixer`` in place of a
    final norm; every block given the indexed attention's 4-D mask and the recurrent one (``conv_mask``), and the token
    ids its per-layer n-gram embeddings hash (``ple_input_ids``) with the padding replaced by ``eos_token_id``, as its
    forward gives them: logits, loss and every gradient equal its forward on a left-padded row (its PLE convolution
    drawn non-zero). Its forward keeps the positions on its cache itself, so cached decoding through the pipeline is
    refused loudly; decoding without caches equals ``generate``'s tokens."""
    from lightning_gpipe.hf import greedy_generate

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen4_exp_text", **QWEN4_EXP))
    with torch.no_grad():
        model.model.layers[0].ple.conv1d.weight.normal_(0.0, 0.3)  # zero as initialised: every path counts
    backbone = to_sequential(model, check=False)
    assert family_of(model).name == "decoder" and backbone[0].streams == (2, True)
    assert backbone[-2].paths == ("model.hyper_connection_mixer",)
    _equal_to_forward(model)
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = (ids != 0).long()
    with pytest.raises(ValueError, match=r"keeps state on its cache itself \(indexer_cache.indexer_position_ids\)"):
        greedy_generate(backbone, ids, mask, max_new_tokens=3)
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=3, pad_token_id=2,
                              eos_token_id=2)  # fmt: skip
    assert torch.equal(greedy_generate(backbone, ids, mask, max_new_tokens=3, eos_token_id=2, kv_cache=False), expected)
