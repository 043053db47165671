"""LoRA through the pipeline with ``peft`` (lightning_gpipe.hf.lora): a peft model is cut as the model inside it,
only the adapters train, each stage reads its base tensors from the base checkpoint and its adapters from an adapter
directory (or initialises them as peft does), and the module's state, checkpoints and ``save_pretrained`` hold the
adapters only. The 2-stage runs are in tests/distributed/test_transformers.py. Every model is built from a small
config."""

import pytest
import torch
from conftest import assert_states_close
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_families import FAMILIES, build  # noqa: E402

from lightning_gpipe.engine.partition import Split, materialize  # noqa: E402
from lightning_gpipe.hf import CausalLM, SafetensorsWeights, to_sequential  # noqa: E402
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.lora import PeftWeights  # noqa: E402
from lightning_gpipe.hf.packing import decoder_input  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules="all-linear")


def peft_model(init_lora_weights=False):
    """The tiny tied Llama with LoRA adapters, both matrices drawn at random unless ``init_lora_weights``."""
    torch.manual_seed(0)
    model = build("llama")
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(**LORA, init_lora_weights=init_lora_weights))


def batch():
    ids = torch.randint(3, 61, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_a_peft_model_is_cut_as_its_model_and_only_the_adapters_get_gradients():
    model = peft_model()
    reference = peft_model()
    ids, mask, labels = batch()
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    backbone = to_sequential(model)
    value = decoder_input(ids, mask)
    for layer in backbone:
        value = layer(value)
    loss = causal_lm_loss(value, labels, None)
    loss.backward()
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=0)
    grads = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        assert (parameter.grad is not None) == parameter.requires_grad == (".lora_" in name), name
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, grads[name].grad, atol=1e-5, rtol=0, msg=name)
    names = {name.split(".", 1)[1] for name in backbone.state_dict()}
    assert names == set(model.get_base_model().state_dict())  # the model's names, peft's inside them


def _stage(peft_config, balance, stage, base_dir, adapter_dir=None):
    """Stage ``stage`` of a peft model built on the meta device, materialised reading base and adapter files."""
    with torch.device("meta"):
        model = build("llama")
        wrapped = peft.get_peft_model(model, peft_config)
    base = SafetensorsWeights(base_dir, model.all_tied_weights_keys, model.base_model_prefix, model)
    holder = nn.Module()
    holder.backbone = to_sequential(wrapped, PeftWeights(wrapped, base, adapter_dir))
    Split(holder, "backbone", balance, stage)
    materialize(holder, torch.device("cpu"))
    return holder


def test_each_stage_reads_its_base_tensors_and_its_adapters_from_their_files(tmp_path):
    torch.manual_seed(0)
    build("llama").save_pretrained(tmp_path / "base")
    peft_model().save_pretrained(tmp_path / "adapter")  # the same base, seeded alike
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    expected = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").get_base_model().state_dict()
    config = peft.PeftConfig.from_pretrained(tmp_path / "adapter")
    seen = set()
    for stage in range(2):
        holder = _stage(config, [2, 4], stage, tmp_path / "base", tmp_path / "adapter")
        state = {key.split(".", 2)[2]: tensor for key, tensor in holder.state_dict().items()}
        assert_states_close(state, {name: expected[name] for name in state}, atol=0.0)
        seen |= set(state)
    assert seen == set(expected)


def test_new_adapters_are_initialised_as_peft_initialises_them(tmp_path):
    """lora_B zeros, lora_A ``nn.Linear``'s uniform (bound 1 / sqrt(fan_in)), the base read from its checkpoint."""
    build("llama").save_pretrained(tmp_path)
    holder = _stage(peft.LoraConfig(**LORA), [6], 0, tmp_path)
    expected = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, tensor in holder.backbone.state_dict().items():
        name = name.split(".", 1)[1]
        if "lora_B" in name:
            assert torch.equal(tensor, torch.zeros_like(tensor)), name
        elif "lora_A" in name:
            bound = tensor.shape[1] ** -0.5
            assert tensor.abs().max() <= bound and tensor.abs().max() > bound / 2, name
        else:
            torch.testing.assert_close(tensor, expected[name.replace(".base_layer.", ".")], atol=0, rtol=0)


def test_a_lora_module_trains_and_keeps_only_its_adapters_and_saves_a_peft_directory(tmp_path):
    build("llama").save_pretrained(tmp_path / "base")
    module = CausalLM(pretrained=str(tmp_path / "base"), lora={**LORA, "init_lora_weights": False})
    module.configure_model()
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in name for name in trainable)
    optimizer = module.configure_optimizers()["optimizer"]
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for p in module.parameters() if p.requires_grad
    }
    state = module.state_dict()
    assert set(state) == trainable  # what a Lightning checkpoint holds
    trained = {name: torch.randn_like(tensor) for name, tensor in state.items()}
    module.load_state_dict(trained)  # strict: the frozen tensors keep their values
    assert_states_close(module.state_dict(), trained, atol=0.0)
    module.save_pretrained(tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ours = {k.split(".", 1)[1]: v for k, v in module.backbone.state_dict().items()}
    assert_states_close(loaded.get_base_model().state_dict(), ours)
    whole = CausalLM(pretrained=str(tmp_path / "base"), lora=True, checkpoint_frozen=True)
    whole.configure_model()
    assert set(whole.state_dict()) == {name for name, _ in whole.named_parameters(remove_duplicate=False)}


def test_an_initialisation_that_reads_the_base_weights_is_refused_when_the_module_is_made():
    with pytest.raises(ValueError, match="init_lora_weights='pissa'.*reads the base weights.*save it"):
        CausalLM(config=dict(FAMILIES["llama"][2]), lora={**LORA, "init_lora_weights": "pissa"})


def test_lora_on_a_gpt2_like_decoder_without_a_plan_equals_the_peft_model():
    """Bloom (ALiBi from the mask, fused QKV), cut by structure: a peft model's loss and its adapters' gradients
    through the backbone equal the peft model's own."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def bloom():
        torch.manual_seed(0)
        config = AutoConfig.for_model("bloom", vocab_size=61, hidden_size=32, n_layer=2, n_head=4)
        model = AutoModelForCausalLM.from_config(config).eval()
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(**LORA, init_lora_weights=False))

    model, reference = bloom(), bloom()
    ids, mask, labels = batch()
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()
    value = decoder_input(ids, mask)
    for layer in to_sequential(model):
        value = layer(value)
    loss = causal_lm_loss(value, labels, None)
    loss.backward()
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=0)
    grads = dict(reference.named_parameters())
    adapters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_" in name for name, _ in adapters)
    for name, parameter in adapters:
        torch.testing.assert_close(parameter.grad, grads[name].grad, atol=1e-5, rtol=0, msg=name)
