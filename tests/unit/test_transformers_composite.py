"""Composite models (lightning_gpipe.hf.composite): a language model with image or audio towers, cut as its language
model is, the towers held by the embedding layer and run by no text; the causal LMs built from a composite config's
text config (as AutoModelForCausalLM builds them); a batch carrying the towers' inputs refused, naming them. Each
against the model's own forward (logits, loss, every gradient; benchmarks/hf_conformance.py's comparison), on
miniatures of small configs."""

import pytest
import torch
from hf_families import conformance

transformers = pytest.importorskip("transformers")

from lightning_gpipe.hf import CausalLM, SelfCheckError, UnsupportedModelError, check_class, to_sequential  # noqa: E402
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.packing import decoder_input  # noqa: E402
from lightning_gpipe.hf.selfcheck import miniature, miniature_config  # noqa: E402

TEXT = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)  # fmt: skip
AUDIO = dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, num_mel_bins=8,
             max_source_positions=16)  # fmt: skip


def _gemma3(**text):
    return transformers.Gemma3Config(
        text_config=dict(TEXT, model_type="gemma3_text", sliding_window=4, **text),
        vision_config=dict(VISION, model_type="siglip_vision_model"),
        mm_tokens_per_image=4,
    )


def _voxtral():
    return transformers.VoxtralConfig(text_config=dict(TEXT, model_type="llama"), audio_config=AUDIO)


@pytest.mark.parametrize(
    "name, config, towers",
    [
        ("Gemma3ForConditionalGeneration", _gemma3, ["model.vision_tower", "model.multi_modal_projector"]),
        ("VoxtralForConditionalGeneration", _voxtral, ["model.audio_tower", "model.multi_modal_projector"]),
    ],
)
def test_a_composite_is_cut_as_its_language_model_and_equals_its_own_forward(name, config, towers):
    """An image-text model (Gemma 3: sliding and full layers, its text config's scaled embedding) and a
    speech-to-text one (Voxtral, of AutoModelForSeq2SeqLM's mapping): the backbone is the language model's embedding
    (holding the towers), blocks, norm and lm_head, under the model's names; applied layer by layer it equals the
    model's forward on text (logits, loss, every gradient), and neither gives the towers a gradient."""
    model_class = getattr(transformers, name)
    assert check_class(model_class, config()).name == "composite"
    tensor, difference = conformance().compare(model_class, config())
    assert difference <= 1e-5, tensor
    model = miniature(model_class, config())
    backbone = to_sequential(model, check=False)
    assert list(backbone[0].paths) == ["model.language_model.embed_tokens", *towers]
    assert backbone[1].paths[0] == "model.language_model.layers.0" and backbone[-1].paths == ("lm_head",)
    ids = torch.randint(3, 61, (2, 9), generator=torch.Generator().manual_seed(3))
    value = decoder_input(ids, torch.ones_like(ids))
    for layer in backbone:
        value = layer(value)
    causal_lm_loss(value, ids, None).backward()
    assert all(p.grad is None for path in towers for p in model.get_submodule(path).parameters())
    assert model.get_submodule("model.language_model.embed_tokens").weight.grad is not None


def test_a_composites_language_model_with_per_layer_embeddings_is_cut_with_them():
    """Gemma 4's image-text model: its language model holds per-layer embeddings (``embed_tokens_per_layer``,
    ``per_layer_model_projection``, ``per_layer_projection_norm``) beside the decoder's modules, from which its forward
    computes each block's per-layer input on text as Gemma 4's text model does; the embedding layer holds them (and
    the towers) and computes them, and the cut equals the model's forward (logits, loss, every gradient)."""
    model_class, config = transformers.Gemma4ForConditionalGeneration, transformers.Gemma4Config(vision_config={})
    tensor, difference = conformance().compare(model_class, config)
    assert difference <= 1e-5, tensor
    own = ["embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"]
    embedding = to_sequential(miniature(model_class, config), check=False)[0]
    towers = ["model.vision_tower", "model.embed_vision"]
    assert list(embedding.paths) == [f"model.language_model.{name}" for name in own] + towers


def test_causal_lm_trains_a_speech_to_text_model_and_refuses_its_audio_in_a_batch():
    """Voxtral is built by AutoModelForSeq2SeqLM only: CausalLM builds it (a decoder, checked as such); a batch carrying
    its audio features is refused naming them, not trained on its text alone; the text trains."""
    module = CausalLM(config=_voxtral(), attn_implementation="eager")
    module.configure_model()
    ids = torch.randint(3, 61, (2, 7), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    assert torch.isfinite(module.training_step(batch, 0))
    with pytest.raises(ValueError, match=r"carries \['input_features'\].*Leave them out"):
        module.backbone_input({**batch, "input_features": torch.zeros(2, 8, 32)})


def test_a_causal_lm_of_a_composite_config_is_built_from_its_text_config():
    """Llama 4's causal LM, given Llama 4's composite config as AutoModelForCausalLM is (it builds the class from the
    text config), holding its base model as ``model`` though its base_model_prefix says ``language_model`` (refused
    before, naming that): taken by the standard layout and equal to its own forward."""
    text = dict(TEXT, intermediate_size_mlp=48, num_local_experts=2, attention_chunk_size=4)
    config = transformers.Llama4Config(text_config=text, vision_config=dict(VISION, model_type="llama4_vision_model"))
    assert check_class(transformers.Llama4ForCausalLM, config).name == "decoder"
    tensor, difference = conformance().compare(transformers.Llama4ForCausalLM, config)
    assert difference <= 1e-5, tensor


def test_a_config_of_towers_without_a_language_models_config_is_refused_naming_them():
    """BLT's four stacks have no text config to cut; two models joined (EncoderDecoderModel's encoder and decoder
    configs, whose miniature is each stack's since T5Gemma) are refused by structure, naming it."""
    with pytest.raises(UnsupportedModelError, match=r"the configs \['patcher_config', 'encoder_config', 'decoder_co"):
        miniature_config(transformers.BltConfig())
    bert = transformers.BertConfig(**{k: TEXT[k] for k in ("vocab_size", "hidden_size", "num_attention_heads")})
    config = transformers.EncoderDecoderConfig(encoder=bert.to_dict(), decoder=bert.to_dict())
    with pytest.raises(UnsupportedModelError, match=r"cannot pipeline EncoderDecoderModel: not the declared plan"):
        to_sequential(transformers.EncoderDecoderModel(config=config), check=False)


def test_what_a_composites_forward_leaves_out_of_its_text_config_is_refused_by_the_self_check():
    """Gemma3ForConditionalGeneration does not soft-cap its logits though its text config sets
    ``final_logit_softcapping`` (its text model does): the cut read from the text config would, so the self-check
    refuses it, naming the head, rather than train another model."""
    with pytest.raises(SelfCheckError, match=r"backbone layer \d+ \(lm_head\) differs"):
        check_class(transformers.Gemma3ForConditionalGeneration, _gemma3(final_logit_softcapping=30.0))
