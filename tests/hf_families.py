"""Tiny configs of the ``transformers`` classes the Hugging Face tests pipeline (built without downloads).

``FAMILIES`` maps a test name to ``(the transformers class, the lightning_gpipe.hf module that trains it, its
config)``. Each model has 3 blocks (hidden 32, 61 tokens, dropout off), so it has 6 backbone layers as a decoder
(embeddings, blocks, final norm, head) and 5 as an encoder (no final norm). Besides the Llama, GPT-2 and BERT of the
first tests, the classes are chosen for what each exercises of the adapter:

- Mistral, Qwen2: a sliding window (4 tokens), on every layer or past ``max_window_layers``.
- Qwen3, OLMo 2: query/key norms inside the block; Phi-3: a fused QKV projection.
- Gemma: the embedding scaled by ``sqrt(hidden_size)`` (in its embedding module).
- Gemma 2: soft-capped logits and attention, alternating sliding and full layers (``layer_types``); Gemma 3: per
  layer type rotary tables.
- Granite: multipliers on the embeddings, residuals, attention and logits; StarCoder 2: LayerNorm, biases, an
  embedding dropout in the model's forward; Cohere 2: logits scaled by ``logit_scale``, sliding and full layers.
- Mixtral, Qwen3-MoE, OLMoE: mixtures of 4 experts (2 per token) whose load-balancing loss counts
  (``output_router_logits=True``, ``router_aux_loss_coef=0.1``); Qwen3-MoE normalises the top-k weights.
- RoBERTa (masked LM), XLM-RoBERTa (sequence classification): encoders without a pooler, positions counted past the
  padding id.
- GPT-NeoX (Pythia), Phi 1/2: cut only where their declared pipeline plans say (``embed_in``, ``emb_dropout``,
  ``final_layer_norm``; ``embed_dropout``, ``final_layernorm``), GPT-NeoX's blocks taking the cache as
  ``layer_past``; partial rotary embeddings, biases, LayerNorm.
- Bloom: no plan, cut by the GPT-2-like layout (``transformer.h``); ALiBi biases every block's layer computes from
  the whole padding mask (over the cached positions when decoding), a norm on the embeddings, tied embeddings.
- GLM-MoE-DSA: each block's indexer takes the top-k indices the previous block chose (``prev_topk_indices``), an
  integer tensor carried from block to block, across the stages; latent attention, dense and sparse MLPs.
- Mamba: no plan, the GPT-2-like layout (``backbone.embeddings``, ``layers``, ``norm_f``) with recurrent blocks
  (``linear_attention``: a convolution and a selective scan, the padding zeroed by the mask), tied embeddings; in
  decoding each stage keeps its blocks' convolution and recurrent states. Jamba: Mamba and attention layers in turn
  (``attn_layer_period=2``), the attention layer's feed-forward a mixture of 4 experts (no load-balancing loss).
"""

import importlib.util
import sys
from pathlib import Path

CONFORMANCE = Path(__file__).resolve().parents[1] / "benchmarks" / "hf_conformance.py"
"""The conformance benchmark, whose comparison of a class with its own forward the tests reuse."""


def conformance():
    """benchmarks/hf_conformance.py as a module, loaded once (registered before it runs: its dataclass looks its
    module up)."""
    if "hf_conformance" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hf_conformance", CONFORMANCE)
        sys.modules["hf_conformance"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["hf_conformance"]


VOCAB = 61
ENDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **ENDS,
)
BERT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    intermediate_size=48,
    max_position_embeddings=64,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
SLIDING = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"])

FAMILIES = {
    "llama": ("LlamaForCausalLM", "CausalLM", dict(model_type="llama", **DECODER, tie_word_embeddings=True)),
    "gpt2": (
        "GPT2LMHeadModel",
        "CausalLM",
        dict(
            model_type="gpt2",
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=3,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ENDS,
        ),
    ),  # fmt: skip
    "bert_mlm": ("BertForMaskedLM", "MaskedLM", dict(model_type="bert", **BERT, pad_token_id=0)),
    "bert_classifier": (
        "BertForSequenceClassification",
        "SequenceClassifier",
        dict(model_type="bert", **BERT, pad_token_id=0, num_labels=3),
    ),
    "mistral": ("MistralForCausalLM", "CausalLM", dict(model_type="mistral", **DECODER, sliding_window=4)),
    "qwen2": (
        "Qwen2ForCausalLM",
        "CausalLM",
        dict(model_type="qwen2", **DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3": ("Qwen3ForCausalLM", "CausalLM", dict(model_type="qwen3", **DECODER, head_dim=8)),
    "phi3": ("Phi3ForCausalLM", "CausalLM", dict(model_type="phi3", **DECODER)),
    "olmo2": ("Olmo2ForCausalLM", "CausalLM", dict(model_type="olmo2", **DECODER)),
    "gemma": ("GemmaForCausalLM", "CausalLM", dict(model_type="gemma", **DECODER, head_dim=8)),
    "gemma2": (
        "Gemma2ForCausalLM",
        "CausalLM",
        dict(
            model_type="gemma2",
            **DECODER,
            **SLIDING,
            head_dim=8,
            query_pre_attn_scalar=8,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=20.0,
        ),
    ),  # fmt: skip
    "gemma3": (
        "Gemma3ForCausalLM",
        "CausalLM",
        dict(model_type="gemma3_text", **DECODER, **SLIDING, head_dim=8, query_pre_attn_scalar=8),
    ),
    "granite": (
        "GraniteForCausalLM",
        "CausalLM",
        dict(
            model_type="granite",
            **DECODER,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),  # fmt: skip
    "starcoder2": (
        "Starcoder2ForCausalLM",
        "CausalLM",
        dict(model_type="starcoder2", **DECODER, embedding_dropout=0.0),
    ),
    "cohere2": ("Cohere2ForCausalLM", "CausalLM", dict(model_type="cohere2", **DECODER, **SLIDING, logit_scale=0.5)),
    "mixtral": ("MixtralForCausalLM", "CausalLM", dict(model_type="mixtral", **DECODER, **MOE, num_local_experts=4)),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "CausalLM",
        dict(
            model_type="qwen3_moe",
            **DECODER,
            **MOE,
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        ),
    ),  # fmt: skip
    "olmoe": ("OlmoeForCausalLM", "CausalLM", dict(model_type="olmoe", **DECODER, **MOE, num_experts=4)),
    "gpt_neox": (
        "GPTNeoXForCausalLM",
        "CausalLM",
        dict(
            model_type="gpt_neox",
            **{k: v for k, v in DECODER.items() if k != "num_key_value_heads"},
            rotary_pct=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),  # fmt: skip
    "phi": ("PhiForCausalLM", "CausalLM", dict(model_type="phi", **DECODER, partial_rotary_factor=0.5)),
    "bloom": (
        "BloomForCausalLM",
        "CausalLM",
        dict(
            model_type="bloom",
            vocab_size=VOCAB,
            hidden_size=32,
            n_layer=3,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **ENDS,
        ),
    ),  # fmt: skip
    "glm_moe_dsa": (
        "GlmMoeDsaForCausalLM",
        "CausalLM",
        dict(
            model_type="glm_moe_dsa",
            **{**DECODER, "num_key_value_heads": 4},
            head_dim=8,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            qk_head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=16,
            num_experts_per_tok=2,
            n_routed_experts=4,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["indexed_attention"] * 3,
            indexer_types=["full", "full", "full"],
        ),
    ),  # fmt: skip
    "mamba": (
        "MambaForCausalLM",
        "CausalLM",
        dict(model_type="mamba", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, state_size=8, **ENDS),
    ),
    "jamba": (
        "JambaForCausalLM",
        "CausalLM",
        dict(
            model_type="jamba",
            **DECODER,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=4,
            mamba_d_state=8,
        ),
    ),  # fmt: skip
    "roberta_mlm": (
        "RobertaForMaskedLM",
        "MaskedLM",
        dict(model_type="roberta", **BERT, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    ),
    "xlm_roberta_classifier": (
        "XLMRobertaForSequenceClassification",
        "SequenceClassifier",
        dict(model_type="xlm-roberta", **BERT, pad_token_id=1, bos_token_id=0, eos_token_id=2, num_labels=3),
    ),
}
"""name: (the ``transformers`` class, the ``lightning_gpipe.hf`` module, its config, dropout off)."""

BART = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=3,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=48,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
    bos_token_id=0,
    pad_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)
T5 = dict(
    vocab_size=VOCAB,
    d_model=32,
    d_ff=48,
    d_kv=8,
    num_layers=3,
    num_decoder_layers=3,
    num_heads=4,
    dropout_rate=0.0,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
)
GEMMA_STACK = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
SEQ2SEQ = {
    "t5": ("T5ForConditionalGeneration", "Seq2SeqLM", dict(model_type="t5", **T5, feed_forward_proj="gated-gelu")),
    "mt5": ("MT5ForConditionalGeneration", "Seq2SeqLM", dict(model_type="mt5", **T5, feed_forward_proj="gated-gelu")),
    "umt5": ("UMT5ForConditionalGeneration", "Seq2SeqLM", dict(model_type="umt5", **T5)),
    "bart": ("BartForConditionalGeneration", "Seq2SeqLM", dict(model_type="bart", **BART)),
    "mbart": ("MBartForConditionalGeneration", "Seq2SeqLM", dict(model_type="mbart", **BART)),
    "marian": ("MarianMTModel", "Seq2SeqLM", dict(model_type="marian", **BART, decoder_vocab_size=VOCAB)),
    "m2m_100": ("M2M100ForConditionalGeneration", "Seq2SeqLM", dict(model_type="m2m_100", **BART)),
    "mvp": ("MvpForConditionalGeneration", "Seq2SeqLM", dict(model_type="mvp", **BART)),
    "longt5": ("LongT5ForConditionalGeneration", "Seq2SeqLM", dict(model_type="longt5", **T5, local_radius=2)),
    "led": ("LEDForConditionalGeneration", "Seq2SeqLM", dict(model_type="led", **BART, attention_window=4)),
    "pegasus_x": (
        "PegasusXForConditionalGeneration",
        "Seq2SeqLM",
        dict(model_type="pegasus_x", **BART, block_size=4, num_global_tokens=2),
    ),
    "bigbird_pegasus": (
        "BigBirdPegasusForConditionalGeneration",
        "Seq2SeqLM",
        dict(model_type="bigbird_pegasus", **BART, block_size=2, num_random_blocks=1),
    ),
    "t5gemma": (
        "T5GemmaForConditionalGeneration",
        "Seq2SeqLM",
        dict(model_type="t5gemma", encoder=GEMMA_STACK, decoder=GEMMA_STACK, vocab_size=VOCAB),
    ),
}
"""The encoder-decoders (``lightning_gpipe.hf.Seq2SeqLM``), 3 encoder and 3 decoder blocks, dropout and layer drop
off: T5 (Flan-T5's gated feed-forward, a relative position bias computed by each stack's first block, logits scaled),
mT5 (no scaling), umT5 (a bias table per block), BART (learned positions offset by 2, a norm on the embeddings, a bias
on the logits), mBART (final norms), Marian (sinusoidal positions, its own target vocabulary size), M2M100 (NLLB's
class: sinusoidal positions from the padding), MVP (BART's layout, its prompts off), LongT5 (local attention in blocks
of 3 tokens), LED (Longformer attention, the source padded to a multiple of 4), Pegasus-X (2 global tokens, the
source padded to a multiple of 4, staggered blocks) and BigBird-Pegasus (block-sparse attention in blocks of 2 tokens,
which its encoder replaces by full attention on a source of at most 14 tokens; final norms named
``layernorm_embedding``) and T5Gemma (two Gemma 2 stacks of their own configs: rotary positions, sliding windows of 4
tokens, soft-capped logits, the decoder's mask from its padding tokens in training)."""

FIRST = ("llama", "gpt2", "bert_mlm", "bert_classifier")
"""The families of the first tests (more runs each: 3 stages, checkpoints, resuming, replicas)."""

MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")
"""The mixtures of experts."""


def build(name: str, **overrides):
    """A new model of family ``name`` (weights drawn from the current random state), config fields overridden."""
    import transformers

    model_class, _, config = {**FAMILIES, **SEQ2SEQ}[name]
    fields = {**config, **overrides}
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    return getattr(transformers, model_class)(config)


def is_decoder(name: str) -> bool:
    """Whether family ``name`` is a causal LM (decodes)."""
    return {**FAMILIES, **SEQ2SEQ}[name][1] == "CausalLM"
