"""Hugging Face models in the pipeline (lightning_gpipe.hf): the adapter against the models' own forward (every
family of tests/hf_families.py, found by structure), names, ties, meta-device builds loading their own weights from
safetensors, greedy decoding with and without the key/value cache, and the LightningModules on one device. The
self-check, mixtures of experts and LoRA have their own files (test_transformers_selfcheck.py,
test_transformers_moe.py, test_transformers_lora.py); the pipelined runs are in
tests/distributed/test_transformers.py.

Every model is built from a small config (the hub is not reachable here).
"""

import importlib
import json
import sys

import pytest
import torch
from conftest import assert_states_close
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_families import BERT, FAMILIES, FIRST, MOE_FAMILIES, build  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from lightning_gpipe.engine.partition import Split, materialize  # noqa: E402
from lightning_gpipe.engine.ties import find_ties  # noqa: E402
from lightning_gpipe.hf import (  # noqa: E402
    SafetensorsWeights,
    UnsupportedModelError,
    family_of,
    positions_from_mask,
    to_sequential,
)
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.moe import router_loss_of  # noqa: E402

VOCAB = 61
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**DECODER, "tie_word_embeddings": True, **overrides}))


def models() -> dict:
    """name -> a function building a tiny model of that architecture (dropout off: one device vs layer by layer)."""
    gpt2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    found_by_structure = {name: lambda name=name, **o: build(name, **o) for name in FAMILIES if name not in FIRST}
    return {
        **found_by_structure,
        "llama": llama,
        "llama_untied": lambda **o: llama(tie_word_embeddings=False, **o),
        "mistral": lambda **o: MistralForCausalLM(MistralConfig(**DECODER, sliding_window=4, **o)),
        "qwen2": lambda **o: Qwen2ForCausalLM(
            Qwen2Config(**DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1, **o)
        ),
        "gpt2": lambda **o: GPT2LMHeadModel(GPT2Config(**gpt2, **no_dropout, **o)),
        "bert_mlm": lambda **o: BertForMaskedLM(BertConfig(**BERT, **o)),
        "bert_classifier": lambda **o: BertForSequenceClassification(BertConfig(**BERT, num_labels=3, **o)),
    }


def batch(rows: int = 3, length: int = 9, seed: int = 0):
    """Token ids and a padding mask with a right-padded and a left-padded row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, length - 3 :] = 0
    mask[2, :2] = 0
    return ids, mask


ENCODERS = ("bert_mlm", "bert_classifier", "roberta_mlm", "xlm_roberta_classifier")
CLASSIFIERS = ("bert_classifier", "xlm_roberta_classifier")
BOTH = ("llama", "llama_untied", "mistral", "qwen2", "gpt2", "bert_mlm", "bert_classifier")
ATTENTIONS = [(name, attention) for name in BOTH for attention in ("eager", "sdpa")]
ATTENTIONS += [
    (name, "eager" if name in ("gemma2", "bloom", "mamba") else "sdpa") for name in FAMILIES if name not in BOTH
]
"""(model, attention implementation): the first families with both, the others with the default ``sdpa`` (Gemma 2
and Bloom have none but ``eager``; Mamba has no attention)."""


def backbone_input(name: str, ids, mask):
    if name in ENCODERS:
        return ids, mask, torch.zeros_like(ids)
    return ids, mask, torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()


def layer_by_layer(backbone: nn.Sequential, value):
    for layer in backbone:
        value = layer(value)
    return value


def hf_loss(name: str, model, output, ids, mask):
    """The loss the model's own forward computes for these labels, on the backbone's ``output``."""
    if name in CLASSIFIERS:
        return nn.functional.cross_entropy(output, torch.tensor([0, 2, 1]))
    labels = ids.masked_fill(mask == 0, -100)
    if name in ENCODERS:
        return nn.functional.cross_entropy(output.view(-1, VOCAB), labels.view(-1))
    return causal_lm_loss(output, labels, router_loss_of(model))


# --------------------------------------------------------------------------- the adapter equals the model


@pytest.mark.parametrize("name, attention", ATTENTIONS)
def test_the_backbone_layer_by_layer_equals_the_models_forward_logits_loss_and_gradients(name, attention):
    """For every family, the unmodified model's loss with labels (a mixture of experts' load-balancing loss
    included) and every parameter's gradient (the routers' through the router statistics)."""
    torch.manual_seed(0)
    model = models()[name](attn_implementation=attention)
    reference = models()[name](attn_implementation=attention)
    reference.load_state_dict(model.state_dict())
    ids, mask = batch()
    labels = ids.masked_fill(mask == 0, -100)
    if name in CLASSIFIERS:
        labels = torch.tensor([0, 2, 1])
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()

    backbone = to_sequential(model)
    output = layer_by_layer(backbone, backbone_input(name, ids, mask))
    loss = hf_loss(name, model, output, ids, mask)
    loss.backward()
    logits = output[0] if name in MOE_FAMILIES else output

    real = mask.bool() if logits.dim() == 3 else slice(None)
    torch.testing.assert_close(logits[real], expected.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=0)
    grads = dict(reference.named_parameters())
    for parameter_name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[parameter_name].grad, atol=1e-5, rtol=0, msg=parameter_name)


def test_layer_names_are_the_models_names_and_ties_are_one_parameter():
    model = llama()
    backbone = to_sequential(model)
    names = {name.split(".", 1)[1] for name in backbone.state_dict()}
    assert names == set(model.state_dict())  # the tied lm_head.weight included, as in the model's state dict
    assert backbone[0].hf_model is model and backbone[-1].lm_head.weight is model.model.embed_tokens.weight

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = backbone

    ties = find_ties(Holder(), "backbone", [2, 4])
    assert [tie.names for tie in ties] == [("backbone.0.model.embed_tokens.weight", "backbone.5.lm_head.weight")]
    untied = to_sequential(models()["llama_untied"]())
    assert find_ties(nn.ModuleDict({"backbone": untied}), "backbone", [2, 4]) == []


def test_training_the_backbone_trains_the_model_and_save_pretrained_round_trips(tmp_path):
    model = llama()
    backbone = to_sequential(model)
    ids, mask = batch()
    optimizer = torch.optim.AdamW(backbone.parameters(), lr=1e-2)
    for _ in range(2):
        loss = hf_loss("llama", model, layer_by_layer(backbone, backbone_input("llama", ids, mask)), ids, mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert_states_close(reloaded.state_dict(), model.state_dict(), atol=0.0)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight


def test_a_model_of_another_layout_is_refused_by_name_with_the_reasons_before_any_step():
    from transformers import XLNetConfig, XLNetLMHeadModel

    model = XLNetLMHeadModel(XLNetConfig(vocab_size=VOCAB, d_model=16, n_layer=1, n_head=2, d_inner=32))
    message = (
        r"XLNetLMHeadModel: not the declared plan layout: it declares no pipeline plan.*"
        r"not the decoder layout: its children are \['lm_loss', 'transformer'\].*"
        r"not the gpt2-like layout: its blocks \(XLNetLayer\) take \['output_g', .*"
        r"no registered family names it"
    )
    with pytest.raises(UnsupportedModelError, match=message):
        to_sequential(model)
    with pytest.raises(UnsupportedModelError, match="MyModel"):
        family_of(type("MyModel", (nn.Module,), {})())


@pytest.mark.parametrize(
    "model_type, fields, reason",
    [
        (
            "qwen3_next",
            dict(layer_types=["hybrid", "full_attention"]),
            "take an attention and a recurrent mask at once",
        ),
        ("megatron-bert", {}, "`bert.encoder` holds \\['layer', 'ln'\\]"),
        ("jamba", dict(output_router_logits=True), "output_router_logits=True: its forward adds a load-balancing loss"),
    ],
)
def test_a_deviation_the_adapter_does_not_handle_is_refused_by_structure(model_type, fields, reason):
    """Hybrid layer types on blocks taking one mask, a final norm in an encoder: modules or layer types the standard
    layouts do not have; a decoder whose forward gives its blocks the padding mask alone (OpenAI GPT: refused by the
    self-check, its loss); the recurrent families of the GPT-2-like layout it does not take: a load-balancing loss
    (Jamba's experts) (on the meta device: nothing is allocated). (RecurrentGemma, refused here before for its stack's
    `normalizer`, is taken by the decoder-stack family: tests/unit/test_transformers_plan.py.)"""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    config = AutoConfig.for_model(model_type, num_hidden_layers=2, **fields)
    auto = AutoModelForMaskedLM if model_type == "megatron-bert" else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    with pytest.raises(UnsupportedModelError, match=reason):
        to_sequential(model)


def test_positions_from_mask_number_each_rows_real_tokens_as_generate_does():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 1, 2, 0], [0, 0, 0, 1]]


GENERATING = [(name, a) for name in ("llama", "mistral", "qwen2", "gpt2") for a in ("eager", "sdpa")]
GENERATING += [("gemma2", "eager"), ("gemma3", "sdpa"), ("mixtral", "sdpa"), ("gpt_neox", "sdpa")]
GENERATING += [("mamba", "eager")]
"""Decoding on one device: the first families with both attention implementations; Gemma 2 (alternating sliding
layers, soft-capped logits), Gemma 3 (a rotary table per layer type), Mixtral (router statistics in the cached
steps), GPT-NeoX (its blocks' cache argument is ``layer_past``) and Mamba (each block's convolution and recurrent
states in its cache). Every decoder family decodes through the pipeline in tests/distributed/test_transformers.py
(Jamba's Mamba and attention layers in turn there)."""


@pytest.mark.parametrize("name, attention", GENERATING)
def test_greedy_generation_with_and_without_the_kv_cache_equals_generate(name, attention):
    from lightning_gpipe.hf import greedy_generate

    torch.manual_seed(0)
    ends = {"bos_token_id": 1, "eos_token_id": 2} if name in ("llama", "mistral", "qwen2") else {}  # the others' set
    model = models()[name](attn_implementation=attention, **ends).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [8, 9, 10, 11, 12, 13], [0, 13, 14, 15, 16, 17]])
    mask = (ids != 0).long()
    backbone = to_sequential(model)  # router statistics as in training (generate's own aux loss fails on its cache)
    model.config.output_router_logits = False
    expected = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=9, pad_token_id=2)
    for kv_cache in (True, False):  # 6 + 9 positions: past Mistral's and Qwen2's sliding window of 4
        generated = greedy_generate(backbone, ids, mask, max_new_tokens=9, eos_token_id=2, kv_cache=kv_cache)
        assert torch.equal(generated, expected), kv_cache
    assert all(not block.kv_cache for block in backbone if hasattr(block, "kv_cache"))  # freed after decoding


def test_a_cached_decoding_step_without_its_cache_names_the_fix():
    model = llama().eval()
    backbone = to_sequential(model)
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    rows = torch.tensor([0])
    with torch.no_grad():
        layer_by_layer(backbone, (ids, mask, positions_from_mask(mask), rows))  # the prompt fills rows [0]'s caches
        step = (ids[:, :1], torch.ones(1, 4, dtype=torch.long), torch.tensor([[3]]))
        layer_by_layer(backbone, (*step, rows))  # the next token
        with pytest.raises(RuntimeError, match=r"holds 0 cached positions for rows \[1\].*clear_kv_caches"):
            layer_by_layer(backbone, (*step, torch.tensor([1])))
        with pytest.raises(
            RuntimeError, match=r"holds 4 cached positions for rows \[0\] but the attention mask says 3"
        ):
            layer_by_layer(backbone, (*step, rows))


# --------------------------------------------------------------------------- meta-device builds, own weights only


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert_mlm", "mixtral"])
def test_a_meta_build_split_into_stages_loads_each_stages_weights_from_safetensors(name, tmp_path):
    """Each stage reads only its own tensors; a mixture of experts' one tensor per expert in the file (as
    ``save_pretrained`` writes it) is converted to the model's one tensor for all, as ``from_pretrained`` does."""
    torch.manual_seed(0)
    saved = models()[name]()
    saved.save_pretrained(tmp_path)
    expected = saved.state_dict()
    ids, mask = batch()
    value = backbone_input(name, ids, mask)
    whole = layer_by_layer(to_sequential(saved), value)
    count = len(to_sequential(saved))
    balance = [2, count - 2]
    outputs = []
    for stage in range(2):
        with torch.device("meta"):
            model = type(saved)(saved.config)
        weights = SafetensorsWeights(tmp_path, model.all_tied_weights_keys, model.base_model_prefix, model)
        holder = nn.Module()
        holder.backbone = to_sequential(model, weights)
        Split(holder, "backbone", balance, stage)
        materialize(holder, torch.device("cpu"))
        assert not any(t.is_meta for t in [*holder.parameters(), *holder.buffers()])
        for key, tensor in holder.state_dict().items():
            torch.testing.assert_close(tensor, expected[key.split(".", 2)[2]], atol=0, rtol=0, msg=key)
        outputs.append(holder)
    hidden = outputs[0].backbone.run(value)
    torch.testing.assert_close(outputs[1].backbone.run(hidden), whole, atol=1e-6, rtol=0)


def test_a_meta_build_with_weights_never_initialises_what_it_reads(tmp_path, monkeypatch):
    """Each tensor is allocated once, by reading it: the inner modules' own resets (a random init of the whole layer
    before it is replaced, which made a stage's largest layer resident twice) are skipped, then restored."""
    llama(tie_word_embeddings=False).save_pretrained(tmp_path)
    resets = []
    for cls in (nn.Linear, nn.Embedding):
        original = cls.reset_parameters
        counted = lambda self, original=original: (resets.append(self), original(self))  # noqa: E731
        monkeypatch.setattr(cls, "reset_parameters", counted)
    with torch.device("meta"):
        model = llama(tie_word_embeddings=False)
    holder = nn.Module()
    holder.backbone = to_sequential(model, SafetensorsWeights(tmp_path))
    resets.clear()  # those of building the model on the meta device
    materialize(holder, torch.device("cpu"))
    assert resets == []
    assert_states_close(model.state_dict(), AutoModelForCausalLM.from_pretrained(tmp_path).state_dict(), atol=0.0)
    assert not any("reset_parameters" in module.__dict__ for module in model.modules())  # the model's own again
    resets.clear()
    model.lm_head.reset_parameters()
    assert resets == [model.lm_head]


def test_a_meta_build_without_weights_initialises_as_the_model_does():
    with torch.device("meta"):
        model = llama()
    holder = nn.Module()
    holder.backbone = to_sequential(model)
    materialize(holder, torch.device("cpu"))
    norm = model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert 0.01 < model.model.layers[0].mlp.up_proj.weight.std() < 0.03  # initializer_range 0.02
    fresh = llama()
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)


def test_safetensors_weights_name_what_is_missing(tmp_path):
    llama(tie_word_embeddings=False).save_pretrained(tmp_path)
    weights = SafetensorsWeights(tmp_path)
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        weights.load(["model.layers.9.mlp.up_proj.weight"])
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        SafetensorsWeights(tmp_path / "nothing")
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"


# --------------------------------------------------------------------------- the LightningModules on one device


@pytest.mark.parametrize(
    "kind, name",
    [("CausalLM", "llama"), ("CausalLM", "gpt2"), ("MaskedLM", "bert_mlm"), ("SequenceClassifier", "bert_classifier")],
)
def test_the_modules_load_a_checkpoint_whole_on_one_device_with_ties_and_the_models_loss(kind, name, tmp_path):
    import lightning_gpipe.hf as hf

    torch.manual_seed(0)
    saved = models()[name](attn_implementation="eager")
    saved.save_pretrained(tmp_path)
    module = getattr(hf, kind)(pretrained=str(tmp_path), attn_implementation="eager")
    module.configure_model()
    assert_states_close({k.split(".", 2)[2]: v for k, v in module.state_dict().items()}, saved.state_dict(), atol=0.0)
    tied = dict(saved.all_tied_weights_keys)
    for copy, source in tied.items():
        assert module.hf_model.get_parameter(copy) is module.hf_model.get_parameter(source)
    ids, mask = batch()
    labels = torch.tensor([0, 2, 1]) if kind == "SequenceClassifier" else ids.masked_fill(mask == 0, -100)
    data = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss = module.loss(module.backbone(module.backbone_input(data)), data)
    if kind == "CausalLM":  # positions 0..S-1 as the model numbers a training batch: its own loss exactly
        torch.testing.assert_close(loss, saved(**data).loss, atol=1e-5, rtol=0)
    assert torch.isfinite(loss)


def test_a_module_from_a_config_initialises_like_the_model_and_refuses_bad_arguments():
    from lightning_gpipe.hf import CausalLM, lr_factor

    module = CausalLM(config={"model_type": "llama", **DECODER}, overrides={"num_hidden_layers": 2})
    module.configure_model()
    assert len(module.backbone) == 2 + 3 and module.hf_model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="pretrained"):
        CausalLM()
    with pytest.raises(ValueError, match="decay"):
        CausalLM(config={"model_type": "llama"}, decay="step")
    factors = [lr_factor(step, 2, 10, "cosine", 0.1) for step in range(11)]
    assert factors[:3] == [0.5, 1.0, 1.0] and factors[-1] == pytest.approx(0.1)


def test_the_example_config_file_writes_out_the_clis_defaults():
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parents[2] / "examples"
    sys.path.insert(0, str(examples))
    from causal_lm.train import main

    defaults = main([], run=False)
    written = main(["--config", str(examples / "causal_lm" / "configs" / "cpu.yaml")], run=False)
    assert dict(written.model.hparams) == dict(defaults.model.hparams)
    assert vars(written.datamodule).keys() == vars(defaults.datamodule).keys()
    for key in ("data_dir", "languages", "tokenizer_name", "max_length", "batch_size", "val_rows"):
        assert getattr(written.datamodule, key) == getattr(defaults.datamodule, key)
    assert written.trainer.max_steps == defaults.trainer.max_steps == 200


def test_a_module_refuses_a_model_of_the_other_kind_when_it_is_made():
    """BERT's causal-LM head without ``is_decoder=True`` is cut as an encoder: not a ``CausalLM``; a config no auto
    class of the module builds is named."""
    from lightning_gpipe.hf import CausalLM, MaskedLM

    bert = {"model_type": "bert", **{k: v for k, v in FAMILIES["bert_mlm"][2].items() if k != "model_type"}}
    with pytest.raises(
        UnsupportedModelError, match="CausalLM trains a decoder, but BertLMHeadModel is cut as an encoder"
    ):
        CausalLM(config=bert)
    with pytest.raises(UnsupportedModelError, match="AutoModelForMaskedLM builds no model from a LlamaConfig"):
        MaskedLM(config=dict(FAMILIES["llama"][2]))


def test_an_older_transformers_is_refused_at_import_naming_the_fix(monkeypatch):
    from lightning_utilities.core import imports

    installed = imports._version
    monkeypatch.setattr(imports, "_version", lambda name: "5.17.0" if name == "transformers" else installed(name))
    for name in [name for name in sys.modules if name.startswith("lightning_gpipe.hf")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"needs transformers 5.24 or newer.*pip install -U 'transformers>=5.24'"):
        importlib.import_module("lightning_gpipe.hf")
