"""Packed rows in lightning_gpipe.hf (issue 47): several documents per row, positions restarting, attention kept inside
each document (a block-diagonal causal mask through the eager and SDPA masks), the loss the mean over the real
tokens. On one device, the backbone layer by layer on a packed batch equals the model's own forward on the same
documents one by one: the loss and every parameter's gradient (tests/distributed/test_hf_packed.py: the same on 2
stages under gpipe, 1f1b and zb-1p, and with LoRA). Tiny models of tests/hf_families.py."""

import sys
from collections import Counter

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import documents_one_by_one  # noqa: E402
from hf_families import build  # noqa: E402

from lightning_gpipe.hf import CausalLM, pack_documents, packed_batch, to_sequential  # noqa: E402
from lightning_gpipe.hf.decoder import causal_lm_loss  # noqa: E402
from lightning_gpipe.hf.masks import MASKS  # noqa: E402
from lightning_gpipe.hf.packing import decoder_input, document_mask, same_document  # noqa: E402

LENGTHS = (7, 3, 12, 1, 5, 9, 4, 11, 2, 6)
"""Document lengths: short and long, one of a single token (nothing to predict); packed into rows of 16 tokens."""


def documents(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 61, (n,), generator=generator).tolist() for n in LENGTHS]


def one_by_one(model, docs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The documents through the model's own forward one at a time (no padding, no packing): the mean of every
    document's next-token cross-entropy over all their targets, and every parameter's gradient of it."""
    loss = documents_one_by_one(model, docs)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def packed(model, docs, row_length: int = 16) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = packed_batch(pack_documents(docs, row_length), pad_token_id=0)
    value = decoder_input(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    for layer in to_sequential(model):
        value = layer(value)
    loss = causal_lm_loss(value, batch["labels"], None, batch["num_targets"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


CASES = [
    ("llama", "eager"),
    ("llama", "sdpa"),
    ("gpt2", "sdpa"),  # learned positions: restarting per document
    ("mistral", "sdpa"),  # a sliding window of 4 on every layer: inside each document
    ("gemma2", "eager"),  # sliding and full layers, soft-capping
    ("qwen3", "sdpa"),
    ("gpt_neox", "eager"),  # cut where its declared plan says
    ("mixtral", "sdpa"),  # experts (without the load-balancing loss, which is not a sum over documents)
]


@pytest.mark.parametrize("family, attention", CASES)
def test_a_packed_batch_equals_its_documents_run_one_by_one_loss_and_every_gradient(family, attention):
    torch.manual_seed(0)
    fields = {"output_router_logits": False} if family == "mixtral" else {}
    model = build(family, attn_implementation=attention, **fields).eval()
    docs = documents()
    expected_loss, expected = one_by_one(model, docs)
    loss, grads = packed(model, docs)
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=0)
    assert grads.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=name)


def test_without_the_document_mask_the_packed_batch_would_differ():
    """The comparison can fail: rows whose documents see each other (positions restarting but one causal mask over
    the row, as a model given a plain padding mask computes them) give another loss."""
    torch.manual_seed(0)
    model = build("llama", attn_implementation="sdpa").eval()
    docs = documents()
    expected_loss, _ = one_by_one(model, docs)
    batch = packed_batch(pack_documents(docs, 16), pad_token_id=0)
    leaking = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], labels=batch["labels"])  # fmt: skip
    assert (leaking.loss - expected_loss).abs() > 10 * 1e-5  # 3e-4 here: well past the tolerance


def test_packing_fills_the_first_row_a_document_fits_and_labels_no_token_of_another_document():
    rows = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], 6)
    assert rows == [[[5, 6, 7], [8, 9], [14]], [[10, 11, 12, 13]]]
    batch = packed_batch(rows, pad_token_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, 11, 12, 13, -100, -100]]
    assert (batch["num_targets"], batch["num_rows"]) == (6, 2)
    later = [[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert len(pack_documents(later, 6)) == 2 and len(pack_documents(later, 6, window=1)) == 3  # the last row only
    with pytest.raises(ValueError, match="7 tokens does not fit rows of 6"):
        pack_documents([[1] * 7], 6)


RECURRENT = [
    {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]},
    {"model_type": "mamba"},
]
"""Models with recurrent layers: a declared plan's linear-attention hybrid (Qwen3-Next), a state-space model of the
GPT-2-like layout (Mamba, every layer ``linear_attention``)."""


@pytest.mark.parametrize("config", RECURRENT, ids=lambda config: config["model_type"])
def test_a_model_with_recurrent_layers_refuses_packed_rows_naming_them(config):
    module = CausalLM(config={**config, "num_hidden_layers": 2, "hidden_size": 32}, self_check=False)
    with torch.device("meta"):
        module.configure_model()
    batch = packed_batch(pack_documents(documents(), 16), pad_token_id=0)
    with pytest.raises(ValueError, match=r"\['linear_attention'\] layers, whose state runs across a packed row"):
        module.backbone_input(batch)


HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
"""The ``Tensor`` methods that read values on the host: on an accelerator each stops the host until the device is
idle."""


@pytest.mark.parametrize("family, attention", [("llama", "sdpa"), ("llama", "eager"), ("gemma2", "eager")])
def test_a_packed_step_reads_no_tensor_value_on_the_host(family, attention, monkeypatch):
    """The packed backbone's forward, loss and backward call none of :data:`HOST_READS`, whoever calls them
    (transformers' mask helpers included): the document mask is built by tensor operations only, and packed rows
    turn off the helpers' check whether a mask may be skipped (which reads the padding mask, twice per block, for an
    unpacked SDPA batch)."""
    reads: Counter = Counter()
    counting = False

    def counted(name, original):
        def read(tensor, *args, **kwargs):
            if counting:
                frame = sys._getframe(1)
                reads[f"{frame.f_code.co_filename}:{frame.f_lineno} {name}"] += 1
            return original(tensor, *args, **kwargs)

        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    torch.manual_seed(0)
    model = build(family, attn_implementation=attention)
    backbone = to_sequential(model)
    batch = packed_batch(pack_documents(documents(), 16), pad_token_id=0)
    counting = True
    value = decoder_input(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    for layer in backbone:
        value = layer(value)
    causal_lm_loss(value, batch["labels"], None, batch["num_targets"]).backward()
    counting = False
    assert not reads, dict(reads)
    if attention == "sdpa":  # the counting sees reads: the same batch unpacked reads its mask on the host
        counting = True
        value = decoder_input(batch["input_ids"], batch["attention_mask"])
        for layer in backbone:
            value = layer(value)
        counting = False
        assert sum(reads.values()) == 2 * model.config.num_hidden_layers, dict(reads)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention", "chunked_attention"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_document_mask_is_the_helpers_own_mask_given_the_document_condition(layer_type, attention):
    """``document_mask`` narrows the helper's eager or SDPA mask by tensor operations; the helper given the same
    condition as ``and_mask_function`` (element by element) builds the identical mask. Another kind of mask takes
    that way."""
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, sliding_window=4, attention_chunk_size=4)
    config._attn_implementation = attention
    batch = packed_batch(pack_documents(documents(), 16), pad_token_id=0)
    _, mask, positions, docs = decoder_input(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    arguments = dict(config=config, inputs_embeds=torch.zeros(*mask.shape, 32), attention_mask=mask, cache=None,
                     position_ids=positions)  # fmt: skip
    helper = MASKS[layer_type]
    expected = helper(**arguments, and_mask_function=same_document(docs))
    assert torch.equal(document_mask(helper, docs, **arguments), expected)
    calls = []

    def other_kind(**given):
        calls.append(sorted(given))
        return None if "and_mask_function" not in given else expected

    assert document_mask(other_kind, docs, **arguments) is expected and len(calls) == 2
