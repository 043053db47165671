"""Encoder-decoders in the pipeline (lightning_gpipe.hf.Seq2SeqLM, lightning_gpipe/hf/seq2seq.py): the cut backbone
against the models' own forward (T5, mT5, umT5, BART, mBART, Marian, M2M100, MVP, LongT5, LED, Pegasus-X,
BigBird-Pegasus, T5Gemma of
tests/hf_families.py: logits, loss, every gradient), T5's relative position bias on a stage starting mid-stack,
meta-device builds loading their own weights, label smoothing, LoRA, what is refused, and generation against
``model.generate`` (greedy with and without the decoder blocks' caches, beam search; also on micro-batches, as a
pipeline runs each step). The pipelined runs are in tests/distributed/test_transformers.py.
"""

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from hf_families import FAMILIES, SEQ2SEQ, VOCAB, build  # noqa: E402

from lightning_gpipe.hf import Seq2SeqLM, UnsupportedModelError, family_of, to_sequential  # noqa: E402
from lightning_gpipe.hf.seq2seq import StackBlock, seq2seq_input, seq2seq_loss  # noqa: E402


def batch(seed: int = 0):
    """Sources ``(3, 9)`` (row 1 right-padded by 3) and labels ``(3, 6)`` (row 2's last 2 unlabelled)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    labels = torch.randint(3, VOCAB, (3, 6), generator=generator)
    labels[2, -2:] = -100
    return ids, mask, labels


def perturbed(model):
    """``model`` with every saved tensor moved off its initialisation (so that every path counts: BART's
    ``final_logits_bias`` starts at zero)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn_like(tensor) * 0.1)
    return model


def through(backbone: nn.Sequential, value):
    for layer in backbone:
        value = layer(value)
    return value


@pytest.mark.parametrize("name", list(SEQ2SEQ))
def test_the_backbone_layer_by_layer_equals_the_models_forward_logits_loss_and_every_gradient(name):
    torch.manual_seed(0)
    model = perturbed(build(name, attn_implementation="eager"))
    reference = build(name, attn_implementation="eager")
    reference.load_state_dict(model.state_dict())
    ids, mask, labels = batch()
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    expected.loss.backward()

    backbone = to_sequential(model)
    assert family_of(model).name == "encoder-decoder"
    logits = through(backbone, seq2seq_input(model, ids, mask, labels=labels, training=model.training))
    loss = seq2seq_loss(logits, labels)
    loss.backward()

    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, expected.loss, atol=1e-6, rtol=0)
    grads = dict(reference.named_parameters())
    for parameter_name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[parameter_name].grad, atol=1e-5, rtol=0, msg=parameter_name)


def test_t5_blocks_after_the_first_hold_its_bias_table_so_a_stage_starting_mid_stack_computes_the_bias():
    """Each later block's layer holds the first block's relative-attention table (one parameter, under the model's
    name), so layers from the middle of a stack alone, given the value the earlier layers passed, equal the whole."""
    torch.manual_seed(0)
    model = perturbed(build("t5", attn_implementation="eager")).eval()
    backbone = to_sequential(model)
    table = model.get_parameter("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    later = [layer for layer in backbone if isinstance(layer, StackBlock) and layer.stack.decoder][1:]
    assert later and all(layer.get_parameter(table_name(layer)) is table for layer in later)
    ids, mask, labels = batch()
    value = seq2seq_input(model, ids, mask, labels=labels)
    cut = next(i for i, layer in enumerate(backbone) if layer is later[0])
    middle = through(backbone[:cut], value)
    stage = nn.Sequential(*backbone[cut:])  # the second stage's layers, without the first decoder block
    torch.testing.assert_close(through(stage, middle), model(input_ids=ids, attention_mask=mask, labels=labels).logits)


def table_name(layer: StackBlock) -> str:
    return next(name for name, _ in layer.named_parameters() if "relative_attention_bias" in name)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_a_meta_device_build_reads_every_layers_tensors_from_the_checkpoint(name, tmp_path):
    """``Seq2SeqLM(pretrained=...)`` built on the meta device and materialised layer by layer, each reading its own
    names (shared embeddings under their tied names, BART's ``final_logits_bias``), equals the saved model."""
    torch.manual_seed(0)
    model = perturbed(build(name, attn_implementation="eager")).eval()
    model.save_pretrained(tmp_path)
    module = Seq2SeqLM(pretrained=str(tmp_path), attn_implementation="eager")
    module.configure_model()
    module.eval()
    ids, mask, labels = batch()
    logits = module.backbone(module.backbone_input({"input_ids": ids, "attention_mask": mask, "labels": labels}))
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(module.loss(logits, {"labels": labels}), expected.loss, atol=1e-6, rtol=0)
    assert module.hf_model.state_dict().keys() == model.state_dict().keys()


def test_label_smoothing_mixes_the_labelled_tokens_cross_entropy_with_the_mean_over_the_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(3, 6, VOCAB)
    _, _, labels = batch()
    module = Seq2SeqLM(config=dict(SEQ2SEQ["bart"][2]), label_smoothing=0.1)
    log_p = logits.log_softmax(-1)[labels != -100]
    chosen = log_p.gather(-1, labels[labels != -100][:, None])[:, 0]
    expected = (0.9 * -chosen - 0.1 * log_p.mean(-1)).mean()
    torch.testing.assert_close(module.loss(logits, {"labels": labels}), expected)
    with pytest.raises(ValueError, match="label_smoothing"):
        Seq2SeqLM(config=dict(SEQ2SEQ["bart"][2]), label_smoothing=1.0)


def test_lora_trains_only_the_adapters_and_the_backbone_equals_the_peft_models_forward():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    module = Seq2SeqLM(config=dict(SEQ2SEQ["t5"][2]), attn_implementation="eager", lora=lora)
    module.configure_model()
    module.eval()
    trained = [name for name, p in module.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    ids, mask, labels = batch()
    logits = module.backbone(module.backbone_input({"input_ids": ids, "attention_mask": mask, "labels": labels}))
    expected = module.peft_model(input_ids=ids, attention_mask=mask, labels=labels).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)


def test_layerdrop_skips_the_blocks_the_models_forward_skips_with_the_same_seed():
    """M2M100 with LayerDrop 0.5 in training: each block layer draws before its block, as the stack's forward."""
    torch.manual_seed(0)
    model = build("m2m_100", attn_implementation="eager", encoder_layerdrop=0.5, decoder_layerdrop=0.5).train()
    ids, mask, labels = batch()
    backbone = to_sequential(model)
    for seed in range(3):
        torch.manual_seed(seed)
        expected = model(input_ids=ids, attention_mask=mask, labels=labels).logits
        torch.manual_seed(seed)
        torch.testing.assert_close(through(backbone, seq2seq_input(model, ids, mask, labels=labels)), expected)


def test_the_stacks_own_dropout_follows_the_backbones_mode_as_lightning_sets_it():
    """BART's stacks apply dropout to the embeddings in their own forward, which the embedding layers run up to the
    first block; the stacks are no modules of those layers, so ``eval()`` on the backbone (Lightning's, before
    validation) must reach them: evaluation equals the model's own evaluation forward (it dropped out before), and
    training after ``train()`` the model's training forward with the same seed."""
    torch.manual_seed(0)
    model = build("bart", attn_implementation="eager", dropout=0.3)
    reference = build("bart", attn_implementation="eager", dropout=0.3)
    reference.load_state_dict(model.state_dict())
    ids, mask, labels = batch()
    backbone = to_sequential(model)
    for training in (False, True):
        backbone.train(training)
        reference.train(training)
        torch.manual_seed(1)
        expected = reference(input_ids=ids, attention_mask=mask, labels=labels).logits
        torch.manual_seed(1)
        logits = through(backbone, seq2seq_input(model, ids, mask, labels=labels, training=training))
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0, msg=f"training={training}")


def test_what_the_layers_cannot_take_is_refused_before_step_1_naming_the_structure():
    with pytest.raises(UnsupportedModelError, match="Seq2SeqLM trains an encoder-decoder, but .* is cut as a decoder"):
        Seq2SeqLM._check_family(Seq2SeqLM.__new__(Seq2SeqLM), "LlamaForCausalLM", family_of(build("llama")))
    with pytest.raises(UnsupportedModelError, match="AutoModelForSeq2SeqLM builds no model from a LlamaConfig"):
        Seq2SeqLM(config=dict(FAMILIES["llama"][2]))
    switch = dict(model_type="switch_transformers", **{k: v for k, v in SEQ2SEQ["t5"][2].items() if k != "model_type"})
    with pytest.raises(UnsupportedModelError, match="output_router_logits=True"):
        Seq2SeqLM(config={**switch, "num_experts": 2, "output_router_logits": True}, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match=r"MvpDecoderLayer\) take MVP's prompts \(use_prompt=True\)"):
        Seq2SeqLM(config={**SEQ2SEQ["mvp"][2], "use_prompt": True}, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="attention is 'transient-global'"):
        Seq2SeqLM(config={**SEQ2SEQ["longt5"][2], "encoder_attention_type": "transient-global"})


def randomized(model, seed: int = 2):
    """``model`` with its saved tensors drawn at random (matrices with standard deviation ``1 / sqrt(fan_in)``, norm
    weights about 1, biases about 0): a fresh model's decoder repeats its start token, which would make its outputs
    alike (as biases about 1 would make BART's)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point():
                scale = tensor.shape[-1] ** -0.5 if tensor.dim() >= 2 else 0.5
                shift = tensor.dim() == 1 and not name.endswith("bias")
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale + shift)
    return model


def seq2seq_module(name: str, generation: dict):
    """A ``Seq2SeqLM`` of family ``name`` built on one device and the model it equals (weights :func:`randomized`),
    both generation configs given the fields of ``generation``; no self-check (the layers' equality is tested above)."""
    model = randomized(build(name, attn_implementation="eager")).eval()
    module = Seq2SeqLM(config=copy.deepcopy(model.config), attn_implementation="eager", self_check=False)
    module.configure_model()
    module.hf_model.load_state_dict(model.state_dict())
    module.eval()
    for config in (model.generation_config, module.hf_model.generation_config):
        for field, value in generation.items():
            setattr(config, field, value)
    return module, model


class MicroBatched(nn.Module):
    """The backbone run on ``chunks`` micro-batches of the value's rows in turn (``torch.tensor_split``, as the
    pipeline splits a step), the logits concatenated: its layers see each decoding step as the stages do."""

    def __init__(self, backbone: nn.Module, chunks: int) -> None:
        super().__init__()
        self.backbone, self.chunks = backbone, chunks

    def forward(self, value):
        parts = zip(*(torch.tensor_split(item, self.chunks) for item in value))
        return torch.cat([self.backbone(part) for part in parts])


@pytest.mark.parametrize(
    "name, generation",
    [
        ("t5", {"eos_token_id": 12}),
        ("bart", {"forced_eos_token_id": 2}),
        ("mbart", {"forced_bos_token_id": 7}),
        ("m2m_100", {}),
    ],
)
def test_greedy_generation_equals_generate_with_the_models_start_forced_and_end_tokens(name, generation):
    """``Seq2SeqLM.generate`` (one backbone call per token, as through the pipeline) against ``model.generate``
    (greedy, its key/value cache): with the decoder blocks' caches (also run on micro-batches, as a pipeline runs
    each step) and without; T5's third row ending early (then padded), BART's forced end at the last step, mBART's
    forced first token (a target language)."""
    module, model = seq2seq_module(name, generation)
    ids, mask, _ = batch()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=8)
    generated = module.generate(ids, mask, max_new_tokens=8)
    assert torch.equal(generated, expected)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=8, kv_cache=False), expected)
    module.backbone = MicroBatched(module.backbone, 2)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=8), expected)
    assert len(set(map(tuple, generated.tolist()))) > 1 or name != "t5"  # the rows differ
    if "forced_bos_token_id" in generation:
        assert (generated[:, 1] == 7).all()
    if "eos_token_id" in generation:
        assert generated[2, -1] == model.generation_config.pad_token_id and (generated[:2, -1] != 0).all()


@pytest.mark.parametrize(
    "name, generation",
    [
        ("t5", {"eos_token_id": 12, "early_stopping": True}),
        ("mbart", {"forced_bos_token_id": 7, "length_penalty": 0.5}),
        ("m2m_100", {"eos_token_id": [43, 9], "early_stopping": "never"}),
    ],
)
def test_beam_search_equals_generate_token_for_token_the_encoder_run_once_one_new_token_per_step(name, generation):
    """``Seq2SeqLM.generate(num_beams=4)`` against ``model.generate(num_beams=4)`` with the same settings, on the
    whole batch and on 2 micro-batches (6 rows each after the first step: the second source's 4 beams split over
    both, so the kept beams' caches move between micro-batches); the encoder's blocks run at the first step only, on
    one row per source, and the decoder's get only the new token afterwards. T5 with ``early_stopping=True``, mBART's
    forced first token with a length penalty, M2M100 with two end ids and ``early_stopping="never"``."""
    module, model = seq2seq_module(name, generation)
    ids, mask, _ = batch()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=4, max_new_tokens=8)
    assert not torch.equal(expected, model.generate(ids, attention_mask=mask, num_beams=1, max_new_tokens=8))
    seen = []
    blocks = [layer for layer in module.backbone if isinstance(layer, StackBlock) and layer.index == 1]  # not 0:
    for layer in blocks:  # the embeddings' stack forward reaches the first block
        block = layer.get_submodule(layer.block)
        block.register_forward_pre_hook(lambda m, args, kwargs: seen.append((m, args[0].shape)), with_kwargs=True)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=8, num_beams=4), expected)
    encoder_block = blocks[0].get_submodule(blocks[0].block)
    assert [shape for m, shape in seen if m is encoder_block] == [(3, 9, 32)]
    assert {shape[:2] for m, shape in seen if m is not encoder_block} == {(3, 1), (12, 1)}
    module.backbone = MicroBatched(module.backbone, 2)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=8, num_beams=4), expected)


def test_bigbird_pegasus_blocks_attend_fully_where_its_encoder_falls_back_and_refuse_block_sparse_attention():
    """BigBird-Pegasus (blocks of 2 tokens, 1 random block): on 9 source tokens, at most ``(5 + 2) * 2``, its encoder
    replaces block-sparse attention by full attention, and so do the blocks' layers: greedy generation equals
    ``model.generate``; on 16 tokens, which its encoder attends block-sparsely, a block's layer refuses."""
    module, model = seq2seq_module("bigbird_pegasus", {})
    ids, mask, _ = batch()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=4)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=4), expected)
    fresh = build("bigbird_pegasus", attn_implementation="eager")
    long = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    value = seq2seq_input(fresh, long, decoder_input_ids=long[:, :4])
    with pytest.raises(RuntimeError, match=r"block-sparse attention \(a source of 16 tokens, more than 14\)"):
        through(to_sequential(fresh, check=False), value)


def test_t5gemma_greedy_generation_past_its_sliding_window_equals_generate_and_its_decoder_masks_padding_in_training():
    """T5Gemma (rotary positions computed by each block's layer, sliding windows of 4 tokens, soft-capped logits):
    greedy decoding of 8 tokens, past the window, equals ``model.generate``; without a ``decoder_attention_mask`` its
    decoder masks the padding tokens of its input in training only (keeping no cache), as the backbone's input does;
    a source with padding and no ``attention_mask`` is refused (its cross-attention would not mask it)."""
    module, model = seq2seq_module("t5gemma", {})
    ids, mask, labels = batch()
    expected = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=8)
    assert torch.equal(module.generate(ids, mask, max_new_tokens=8), expected)
    targets = seq2seq_input(model, ids, mask, labels=labels)[2]
    assert (targets == 0).any()  # the unlabelled positions, shifted in as padding
    assert seq2seq_input(model, ids, mask, labels=labels)[3].all()
    assert torch.equal(seq2seq_input(model, ids, mask, labels=labels, training=True)[3], (targets != 0).long())
    with pytest.raises(ValueError, match="give the batch's `attention_mask`"):
        seq2seq_input(model, ids.masked_fill(mask == 0, 0), labels=labels)
