"""The declared pipeline plan first (lightning_gpipe.hf.adapter.declared_cut, transformers PR #36091): a causal LM
whose config declares ``base_model_pp_plan`` is cut at the modules the plan names (GPT-NeoX's and Phi's names too),
structure the fallback, the self-check always, a disagreement named; and benchmarks/hf_conformance.py's verdict on a
representative few of the installed transformers' declaring classes (the whole sweep is that benchmark). Built from
small configs."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

from lightning_gpipe.hf import SelfCheckError, UnsupportedModelError, family_of, to_sequential  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_conformance.py"
TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            max_position_embeddings=64)  # fmt: skip


def _conformance():
    if "hf_conformance" not in sys.modules:  # registered first: its dataclass looks its module up
        spec = importlib.util.spec_from_file_location("hf_conformance", SCRIPT)
        sys.modules["hf_conformance"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["hf_conformance"]


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


@pytest.mark.parametrize("model_type", ["gpt_neox", "phi", "codegen", "qwen3_next", "minicpm3", "llama"])
def test_declaring_classes_of_the_installed_transformers_equal_their_own_forward(model_type):
    """benchmarks/hf_conformance.py on a few: a plan with other names (GPT-NeoX, Phi, CodeGen), linear-attention
    layers (Qwen3-Next), the hidden states scaled before the head (MiniCPM3), the standard layout (Llama): logits,
    loss and every gradient of the backbone layer by layer within 1e-5 of the class's own forward."""
    result = _conformance().conform(model_type)
    assert (result.verdict, result.family) == ("equal", "declared plan"), result.detail


def test_the_conformance_comparison_can_find_a_difference():
    """The sweep's own comparison (not the self-check) sees a class whose forward differs from its cut."""

    class DoubledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.logits = output.logits * 2
            return output

    tensor, difference = _conformance().compare(DoubledLogits, LlamaConfig(**TINY))
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
