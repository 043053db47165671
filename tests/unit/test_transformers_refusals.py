"""What lightning_gpipe.hf takes and refuses, and how it says so (issue 47's four refusals): logit scaling before the
head (MiniCPM3) cut exactly; router logits ignored, with one note, where the class adds no load-balancing loss
(DeepSeek-V3), and ``check=False`` doing what it says; layer types the adapter does not know, a block's failure in
the cut and a base-model prefix it does not follow (Llama 4) named as such, with what the user can do. Every model is
built from a small config."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoConfig,
    BeamForCausalLM,
    DeepseekV3ForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MiniCPM3ForCausalLM,
    MixtralForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from lightning_gpipe.hf import SelfCheckError, UnsupportedModelError, check_class, to_sequential  # noqa: E402
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.moe import router_loss_of  # noqa: E402
from lightning_gpipe.hf.packing import decoder_input  # noqa: E402

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
LATENT = dict(TINY, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
              v_head_dim=8)  # fmt: skip
"""Multi-head latent attention (MiniCPM3, DeepSeek-V3): as many key/value heads as heads."""


def _batch():
    ids = torch.randint(3, 61, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, -3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _assert_cut_equals_forward(model) -> None:
    """The backbone applied layer by layer equals the model's forward: the loss and every parameter's gradient."""
    ids, mask, labels = _batch()
    model.eval()
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    backbone = to_sequential(model)
    value = decoder_input(ids, mask)
    for layer in backbone:
        value = layer(value)
    loss = causal_lm_loss(value, labels, router_loss_of(model))
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=0)
    loss.backward()
    assert grads
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name], atol=1e-5, rtol=0, msg=name)


def test_minicpm3s_scaling_of_the_hidden_states_before_the_head_is_cut_exactly():
    """MiniCPM3 divides the final norm's output by ``hidden_size / dim_model_base`` before the head (its config's
    ``logits_scaling`` property); refused before as "backbone layer 3 (model.norm) differs by 15.4"."""
    config = AutoConfig.for_model("minicpm3", **LATENT, dim_model_base=8)
    assert config.logits_scaling == 4.0
    assert check_class(MiniCPM3ForCausalLM, config).name
    torch.manual_seed(0)
    _assert_cut_equals_forward(MiniCPM3ForCausalLM(config))


def _deepseek_v3(**overrides):
    config = AutoConfig.for_model("deepseek_v3", **LATENT, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, moe_intermediate_size=16, first_k_dense_replace=1,
                                  **overrides)  # fmt: skip
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config)


def test_router_logits_of_a_class_that_adds_no_load_balancing_loss_are_ignored_with_one_note(caplog):
    """DeepSeek-V3 returns its router logits but adds no auxiliary loss: ``output_router_logits=True`` changes
    nothing of its loss, so it is ignored (noted once per class), with or without the check; refused before with a
    ValueError that ``check=False`` raised again."""
    model = _deepseek_v3(output_router_logits=True)
    with caplog.at_level(logging.INFO):
        assert router_loss_of(model) is None
        assert len(to_sequential(model, check=False)) == 6  # embeddings, 3 blocks, norm, head
        assert router_loss_of(model) is None
    notes = [r.getMessage() for r in caplog.records if "output_router_logits" in r.getMessage()]
    assert notes == [
        "DeepseekV3ForCausalLM adds no load-balancing loss: lightning_gpipe.hf ignores output_router_logits=True."
    ]
    _assert_cut_equals_forward(model)  # with the check


class RecorderlessMixtral(MixtralForCausalLM):
    """Adds Mixtral's load-balancing loss, but records its router logits from no module class."""

    _can_record_outputs: dict = {}


@pytest.mark.parametrize("check", [True, False])
def test_a_load_balancing_loss_the_adapter_cannot_carry_is_refused_alike_with_and_without_the_check(check):
    config = AutoConfig.for_model("mixtral", **TINY, num_local_experts=4, num_experts_per_tok=2,
                                  output_router_logits=True)  # fmt: skip
    with pytest.raises(UnsupportedModelError) as refused:
        to_sequential(RecorderlessMixtral(config), check=check)
    assert type(refused.value) is UnsupportedModelError  # not a failed check: skipping the check cannot help
    message = str(refused.value)
    assert "RecorderlessMixtral adds a load-balancing loss" in message and "check=False" not in message
    assert "overrides={'output_router_logits': False}" in message


def test_layer_types_the_adapter_does_not_know_are_named_with_what_to_do():
    """A layer type for which transformers declares no mask (LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING)."""
    config = LlamaConfig(**TINY)
    config.layer_types = ["full_attention", "lattice_attention", "full_attention"]  # past the config's validation
    with pytest.raises(UnsupportedModelError) as refused:
        to_sequential(LlamaForCausalLM(config))
    message = str(refused.value)
    assert "its layer types include ['lattice_attention'], which the adapter does not know" in message
    assert "Register a Family" in message and "'Adding a family'" in message


def test_a_hybrid_layer_type_on_blocks_taking_one_mask_is_named():
    """``hybrid`` layers (Inkling's) take a full and a recurrent mask at once: Llama's blocks take one."""
    config = LlamaConfig(**TINY, layer_types=["full_attention", "hybrid", "full_attention"])
    with pytest.raises(UnsupportedModelError) as refused:
        to_sequential(LlamaForCausalLM(config))
    message = str(refused.value)
    assert "take an attention and a recurrent mask at once" in message and "take 0 mask arguments" in message


def test_a_layer_type_without_rotary_parameters_gets_what_its_modeling_module_computes():
    """Beam's full-attention layers take no rotary embedding (``rope_parameters['full_attention']`` is None) but an
    attention scaling its modeling module computes from the positions (``compute_attention_scaling``); refused
    before, as "'full_attention' layers have no rotary parameters". Cut exactly: loss and every gradient."""
    config = AutoConfig.for_model("beam", **TINY, layer_types=["sliding_attention", "full_attention"] * 1
                                  + ["sliding_attention"], sliding_window=4, num_local_experts=4,
                                  num_experts_per_tok=2)  # fmt: skip
    assert config.rope_parameters["full_attention"] is None
    assert check_class(BeamForCausalLM, config).name == "declared plan"
    torch.manual_seed(0)
    _assert_cut_equals_forward(BeamForCausalLM(config))


class _NeedsFlag(LlamaDecoderLayer):
    def forward(self, hidden_states, **kwargs):
        assert kwargs.pop("flag")  # a KeyError without it
        return super().forward(hidden_states, **kwargs)


class FlagLlama(LlamaForCausalLM):
    """Its forward gives its blocks an argument the adapter does not give them."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.__class__ = _NeedsFlag

    def forward(self, *args, **kwargs):
        return super().forward(*args, flag=True, **kwargs)


def test_a_backbone_layer_failing_where_the_forward_runs_is_named_and_check_false_not_offered():
    with pytest.raises(SelfCheckError) as refused:
        check_class(FlagLlama, LlamaConfig(**TINY))
    message = str(refused.value)
    assert "backbone layer 1 (model.layers.0, model.rotary_emb) fails" in message and "KeyError: 'flag'" in message
    assert "skipping the check would not help" in message and "`check=False`" not in message


def test_a_base_model_prefix_that_names_no_child_finds_the_child_of_its_config_class():
    """Llama 4's text model says ``base_model_prefix = "language_model"`` (its multimodal checkpoints' name) but holds
    its base model as ``model``: refused before, naming that; now its one child of its config's class is the base
    model, cut under its own name (tests/unit/test_transformers_composite.py: equal to its forward)."""
    config = Llama4TextConfig(**{**TINY, "intermediate_size_mlp": 48}, num_local_experts=2)
    backbone = to_sequential(Llama4ForCausalLM(config), check=False)
    assert backbone[0].paths[0] == "model.embed_tokens" and backbone[-2].paths == ("model.norm",)
