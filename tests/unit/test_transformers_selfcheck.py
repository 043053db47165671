"""The adapter's self-check (lightning_gpipe.hf.selfcheck): a class whose forward computes something the standard
layout does not is refused before anything is built, with the class and the first differing backbone layer named;
the miniature keeps the config's options. Every model is built from a small config."""

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
)

from lightning_gpipe.hf import CausalLM, SelfCheckError, check_class, to_sequential  # noqa: E402
from lightning_gpipe.hf.selfcheck import miniature_config  # noqa: E402

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


class ScaledLogitsLlama(LlamaForCausalLM):
    """Looks like a Llama, but its forward scales the logits (as Granite's does, which its config declares)."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 2
        return output


class _ScaledEmbeddingsModel(LlamaModel):
    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        return super().forward(inputs_embeds=self.embed_tokens(input_ids) * 2, **kwargs)


class ScaledEmbeddingsLlama(LlamaForCausalLM):
    """Looks like a Llama, but its base model scales the embeddings in its forward (as Gemma 1 did in
    transformers 4)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = _ScaledEmbeddingsModel(config)


class LogitDropoutLlama(LlamaForCausalLM):
    """Equal to a Llama in evaluation, but its forward applies a dropout to the logits in training."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = nn.functional.dropout(output.logits, 0.1, self.training)
        return output


@pytest.mark.parametrize(
    "model_class, where, mode",
    [
        (ScaledLogitsLlama, r"backbone layer 4 \(lm_head\)", "evaluation"),
        (ScaledEmbeddingsLlama, r"backbone layer 0 \(model.embed_tokens\)", "evaluation"),
        (LogitDropoutLlama, r"backbone layer 4 \(lm_head\)", "training"),
    ],
)
def test_a_class_whose_forward_differs_from_its_cut_is_refused_with_the_first_differing_layer(model_class, where, mode):
    """The miniature has 2 blocks: layers 0 (embeddings), 1-2 (blocks), 3 (final norm), 4 (head)."""
    model = model_class(LlamaConfig(**TINY))
    message = f"{model_class.__name__} is not cut into backbone layers correctly: {where} differs .* in {mode} mode"
    with pytest.raises(SelfCheckError, match=message):
        to_sequential(model)
    assert len(to_sequential(model, check=False)) == 6  # cut as a Llama when the user takes the responsibility


def test_a_module_refuses_a_class_that_differs_when_it_is_made_before_any_process_starts():
    class ScaledConfig(LlamaConfig):
        model_type = "scaled_llama_selfcheck_test"

    class Registered(ScaledLogitsLlama):
        config_class = ScaledConfig

    AutoConfig.register(ScaledConfig.model_type, ScaledConfig)
    AutoModelForCausalLM.register(ScaledConfig, Registered)
    with pytest.raises(SelfCheckError, match="Registered is not cut into backbone layers correctly"):
        CausalLM(config={"model_type": ScaledConfig.model_type, **TINY})
    CausalLM(config={"model_type": ScaledConfig.model_type, **TINY}, self_check=False)  # the user's responsibility


def test_the_miniature_keeps_every_kind_of_layer_and_the_options_at_small_widths():
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config = Gemma3TextConfig(**{**TINY, "num_hidden_layers": 6, "vocab_size": 1000}, layer_types=layer_types,
                              sliding_window=512, head_dim=256, final_logit_softcapping=30.0, eos_token_id=999,
                              attention_dropout=0.1)  # fmt: skip
    mini = miniature_config(config)
    assert mini.num_hidden_layers == 2 and mini.layer_types == ["sliding_attention", "full_attention"]  # blocks 0, 5
    assert (mini.hidden_size, mini.head_dim, mini.num_attention_heads, mini.num_key_value_heads) == (64, 16, 4, 2)
    assert (mini.vocab_size, mini.eos_token_id, mini.sliding_window) == (128, 127, 4)
    assert (mini.final_logit_softcapping, mini.attention_dropout, mini.use_cache) == (30.0, 0.1, False)
    assert config.num_hidden_layers == 6 and config.sliding_window == 512  # the user's config as it was


def test_the_check_names_the_family_and_leaves_the_random_state_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    family = check_class(LlamaForCausalLM, LlamaConfig(**TINY))
    assert torch.equal(torch.rand(3), expected)  # the miniature's random weights come from a generator of its own
    assert family.name == "declared plan" and not family.encoder  # Llama's config declares base_model_pp_plan


def test_a_miniature_that_cannot_be_built_is_refused_with_the_error_and_the_way_out():
    class WideOnly(LlamaForCausalLM):
        def __init__(self, config) -> None:
            if config.hidden_size < 128:
                raise ValueError("hidden_size must be at least 128")
            super().__init__(config)

    with pytest.raises(SelfCheckError, match=r"could not check how it cuts WideOnly.*at least 128.*`check=False`"):
        check_class(WideOnly, LlamaConfig(**{**TINY, "hidden_size": 128}))


def test_a_heterogeneous_configs_per_layer_widths_are_shrunk_per_layer():
    """Dots3-Note's sliding layers have widths of their own (``per_layer_config``), which its global config refuses to
    give (refused before, "'num_key_value_heads' is a per-layer attribute"): the miniature keeps a layer of each kind
    with its own overrides shrunk alike, the head split into rotary and other parts as the config splits it."""
    config = transformers.AutoConfig.for_model("dots3_note_text")
    mini = miniature_config(config)
    assert mini.layer_types == ["indexed_attention", "indexed_attention", "sliding_attention"]
    sliding, indexed = mini.per_layer_config[2], mini.per_layer_config[0]
    assert (sliding.num_attention_heads, sliding.num_key_value_heads, sliding.kv_lora_rank) == (4, 4, 16)
    assert sliding.head_dim == sliding.qk_nope_head_dim + sliding.qk_rope_head_dim == 32  # as the config's 192 + 64
    assert (indexed.head_dim, indexed.qk_rope_head_dim, indexed.qk_nope_head_dim) == (32, 8, 8)  # rotary a quarter
    assert config.per_layer_config[2].num_attention_heads == 64  # the user's config unchanged


def test_a_multimodal_configs_towers_are_cut_to_one_block_in_the_miniature():
    """Phi-4-multimodal's embedding layer holds its vision (27 layers) and audio (24 blocks) towers beside the token
    embedding: the miniature keeps their widths and one block each, the user's config unchanged."""
    config = transformers.AutoConfig.for_model("phi4_multimodal")
    mini = miniature_config(config)
    assert (mini.vision_config.num_hidden_layers, mini.audio_config.num_blocks) == (1, 1)
    assert mini.vision_config.hidden_size == config.vision_config.hidden_size
    assert (config.vision_config.num_hidden_layers, config.audio_config.num_blocks) == (27, 24)


def test_the_miniature_keeps_two_hybrid_layers_sharing_a_block_and_derives_its_widths_again():
    """Zamba's and Zamba2's hybrid layers add one attention block, shared and tied across them, to a Mamba layer
    (refused before: a miniature of one hybrid layer, which ``transformers`` cannot tie, and widths its config had
    derived from the full ones): the miniature keeps two of them and derives again what the class derives, where the
    shrinking left the full config's (the attention's input, twice the hidden size; Mamba-2's head width; which layers
    are hybrid; Zamba's ``mamba_dt_rank="auto"``)."""
    zamba, zamba2 = (miniature_config(AutoConfig.for_model(name)) for name in ("zamba", "zamba2"))
    for mini in (zamba, zamba2):
        assert mini.layers_block_type == ["linear_attention", "hybrid", "hybrid"]
        assert mini.attention_hidden_size == 2 * mini.hidden_size == 128
    assert zamba.mamba_dt_rank == 4 and (zamba2.hybrid_layer_ids, zamba2.mamba_headdim) == ([1, 2], 16)


def test_the_miniature_keeps_layers_reusing_keys_and_values_and_one_dense_layer_before_the_experts():
    """Gemma 3n's last 15 of 35 layers reuse the keys and values of the last earlier layer of their type (refused
    before: a miniature of 2 layers with 15 sharing could not be built): the miniature keeps each kind of layer before
    them and after them, as many sharing as it keeps, so every sharing type still has a layer producing its keys.
    DeepSeek-V3's 3 dense layers before its experts (LFM2-MoE's 2): one, so the miniature's second layer is a
    mixture's."""
    mini = miniature_config(AutoConfig.for_model("gemma3n_text"))
    assert mini.num_kv_shared_layers == 2 and mini.layer_types[-2:] == ["sliding_attention", "full_attention"]
    # the config's own reading: the last layer of each type before the sharing ones stores, the sharing ones reuse
    assert mini.kv_sharing_modes == [None] * (mini.num_hidden_layers - 4) + ["store"] * 2 + ["reuse"] * 2
    assert miniature_config(AutoConfig.for_model("deepseek_v3")).first_k_dense_replace == 1
    assert miniature_config(AutoConfig.for_model("lfm2_moe", layer_types=["conv"] * 32)).num_dense_layers == 1
