"""Conformance of ``lightning_gpipe.hf`` over every causal-LM class of the installed ``transformers`` that declares a
pipeline plan (``config.base_model_pp_plan``, transformers PR #36091), and (``--seq2seq``) over every
``AutoModelForSeq2SeqLM`` class, and (``--all``) over every causal-LM class, declared plan or not: equal, refused or
wrong.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class declares a plan, a tiny config (the
type's default config, fixed where ``transformers``' own default cannot build or run its model, see
:data:`CONFIG_FIXES`, then shrunk as the self-check shrinks it: ``miniature_config``) and:

- ``refused``: ``check_class`` raises ``UnsupportedModelError`` or ``SelfCheckError`` (the message is the reason);
- ``equal``: taken, and the backbone applied layer by layer equals the class's own forward on a probe of its own
  (2 rows of 13 tokens, one left- and one right-padded, a seed other than the self-check's): the logits on the real
  tokens, the loss with labels and every parameter's gradient, each within 1e-5 (absolute, or relative to the
  tensor's largest entry where that exceeds 1);
- ``wrong``: taken, but something differs (the worst tensor named): the adapter would train another model.

With ``--all`` the types are every one of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` with a config (196 in ``transformers``
5.24), each class trained by ``lightning_gpipe.hf.CausalLM``: the BERT-style causal-LM heads are built with
``is_decoder=True``, as ``transformers`` tells their users (:data:`CONFIG_FIXES`); a class cut as an encoder is
refused, as ``CausalLM`` refuses it; a class whose own forward fails on the probe
counts as wrong, its error named (the self-check ran its forward already).

With ``--seq2seq`` the types are those of ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`` (none declares a plan),
each class trained by ``lightning_gpipe.hf.Seq2SeqLM``; the probe adds labels of 2 rows of 7 tokens (the last 2 of
the second unlabelled), from which both sides shift the decoder's input. The speech-to-text language models the
mapping lists (Voxtral, Qwen2-Audio...: a decoder with an audio tower, cut as a composite,
``lightning_gpipe.hf.composite``) are trained by ``lightning_gpipe.hf.CausalLM`` and compared as causal LMs, on
their text.

A class is built from the config ``transformers``' auto classes build it from (a composite config's text config
where the class is its language model's, ``lightning_gpipe.hf.selfcheck.built_config``).

Run from the repository root (a few minutes on one CPU thread)::

    python benchmarks/hf_conformance.py                 # every declaring class, a table and the counts
    python benchmarks/hf_conformance.py --only gpt_neox phi qwen3_next
    python benchmarks/hf_conformance.py --json out.json
    python benchmarks/hf_conformance.py --seq2seq       # every AutoModelForSeq2SeqLM class
    python benchmarks/hf_conformance.py --all           # every causal-LM class, declared plan or not

tests/unit/test_transformers_plan.py runs :func:`conform` on a representative few; docs/transformers.md gives the
counts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QSA = dict(indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048, indexer_compress_ratio=4)
"""Qwen4-Exp's token indexer (QSA) widths, which its default config leaves unset (see :data:`CONFIG_FIXES`)."""
BERT_DECODERS = tuple(
    "bert bert-generation camembert data2vec-text electra ernie megatron-bert rembert roberta roberta-prelayernorm"
    " roc_bert roformer xlm-roberta xlm-roberta-xl".split()
)
"""The BERT-style causal-LM heads built with ``is_decoder=True`` (besides BigBird and X-MOD, in :data:`CONFIG_FIXES`
with more)."""

CONFIG_FIXES: dict[str, dict] = {
    "ministral": {"head_dim": 128},  # default head_dim None: its attention takes None ** -0.5
    "deepseek_v2": {"num_experts_per_tok": 6},  # default None: its router's topk takes k=None
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 8, "n_shared_experts": 2},  # defaults None: no experts
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    # no decoder_start_token_id by default: their forward cannot shift labels (T5's checkpoints' value)
    **{t5: {"decoder_start_token_id": 0} for t5 in ("t5", "longt5", "switch_transformers")},
    **{hunyuan: {"head_dim": 128} for hunyuan in ("hunyuan_v1_dense", "hunyuan_v1_moe")},  # head_dim None ** -0.5
    "nemotron": {"num_key_value_heads": 8},  # default None: its attention divides the heads by None
    # its attention reads a rope_theta its attention config does not declare, and clamps to clip_qkv (default None)
    "dbrx": {"attn_config": {"rope_theta": 5e5, "clip_qkv": 8}},
    # layer_types None: no layer is told conv or attention (LFM2-8B-A1B's: attention every fourth-ish layer)
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
    "reformer": {"is_decoder": True},  # its causal-LM head asserts is_decoder
    # its layer types name indexed attention, whose indexer (QSA) has no default widths
    **{qwen4: qsa for qwen4, qsa in (("qwen4_exp_text", QSA), ("qwen4_exp", {"text_config": QSA}))},
    # BERT-style causal-LM heads are causal LMs with is_decoder=True, as transformers tells their users ("If you want
    # to use `BertLMHeadModel` as a standalone, add `is_decoder=True.`"); by default they are bidirectional encoders
    **{bert: {"is_decoder": True} for bert in BERT_DECODERS},
    # a BigBird decoder attends fully (its block-sparse attention is bidirectional); X-MOD's default adapter language
    "big_bird": {"is_decoder": True, "attention_type": "original_full"},
    "xmod": {"is_decoder": True, "default_language": "en_XX"},
    # its config requires a text config without per-layer inputs, which Gemma 4's default text config has
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
"""Fields set on ``transformers`` 5.24's default configs that cannot build or run their own model, or build it as
another kind of model (a BERT-style causal-LM head without ``is_decoder=True`` is a bidirectional encoder); the values
are the types' documented ones, nothing of the adapter's."""

TOLERANCE = 1e-5
ROWS, LENGTH = 2, 13


@dataclass
class Result:
    """One class's verdict: ``equal``, ``refused`` or ``wrong``, with the family that took it (or ``None``) and the
    reason (refused), the worst difference (equal) or the worst tensor (wrong)."""

    model_type: str
    model_class: str
    verdict: str
    family: str | None
    detail: str
    seconds: float


def declaring_types() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every causal LM whose config class declares ``base_model_pp_plan``."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [
        (model_type, name)
        for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
        if model_type in CONFIG_MAPPING and getattr(CONFIG_MAPPING[model_type], "base_model_pp_plan", None)
    ]


def causal_lm_types() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every causal LM with a config, declared plan or not."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return [
        (model_type, name)
        for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()
        if model_type in CONFIG_MAPPING
    ]


def seq2seq_types() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every ``AutoModelForSeq2SeqLM`` class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.items())


def tiny_config(model_type: str):
    """The type's default config with :data:`CONFIG_FIXES`, shrunk as the self-check's miniature is."""
    from transformers import AutoConfig

    from lightning_gpipe.hf.selfcheck import miniature_config

    return miniature_config(AutoConfig.for_model(model_type, **CONFIG_FIXES.get(model_type, {})))


def _probe() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (ROWS, LENGTH), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[1, -3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _worst(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> tuple[str, float]:
    """The tensor that differs most, relative to its largest entry where that exceeds 1."""
    worst = ("", -1.0)
    for name, expected in theirs.items():
        got = ours.get(name)
        if got is None or got.shape != expected.shape:
            return name, float("inf")
        difference = (got.double() - expected.double()).abs().max().item()
        difference /= max(1.0, expected.abs().max().item())
        if not difference <= worst[1]:  # NaN counts as the worst
            worst = (name, difference)
    return worst


def compare(model_class: type, config) -> tuple[str, float]:
    """The backbone layer by layer against ``model_class``'s own forward on a miniature of ``config``: ``(worst
    tensor, its difference)`` over the logits, the loss and every gradient."""
    from lightning_gpipe.hf import to_sequential
    from lightning_gpipe.hf.decoder import causal_lm_loss, shifts_labels
    from lightning_gpipe.hf.moe import router_loss_of
    from lightning_gpipe.hf.packing import decoder_input
    from lightning_gpipe.hf.selfcheck import miniature

    model = miniature(model_class, config).eval()
    ids, mask, labels = _probe()
    output = model(input_ids=ids, attention_mask=mask, labels=labels)
    output.loss.backward()
    real = mask.bool()
    theirs = {"logits": output.logits[real].detach(), "loss": output.loss.detach()}
    theirs |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    value = decoder_input(ids, mask)
    for layer in to_sequential(model, check=False):
        value = layer(value)
    loss = causal_lm_loss(value, labels, router_loss_of(model), shift=shifts_labels(model_class))
    loss.backward()
    logits = value[0] if isinstance(value, tuple) else value
    ours = {"logits": logits[real].detach(), "loss": loss.detach()}
    ours |= {f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _worst(ours, theirs)


def compare_seq2seq(model_class: type, config) -> tuple[str, float]:
    """:func:`compare` for an encoder-decoder (``Seq2SeqLM``'s backbone input and loss)."""
    from lightning_gpipe.hf import to_sequential
    from lightning_gpipe.hf.selfcheck import miniature
    from lightning_gpipe.hf.seq2seq import seq2seq_input, seq2seq_loss

    model = miniature(model_class, config).eval()
    ids, mask, _ = _probe()
    labels = torch.randint(3, 128, (ROWS, 7), generator=torch.Generator().manual_seed(8))
    labels[1, -2:] = -100
    output = model(input_ids=ids, attention_mask=mask, labels=labels)
    output.loss.backward()
    theirs = {"logits": output.logits.detach(), "loss": output.loss.detach()}
    theirs |= {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    value = seq2seq_input(model, ids, mask, labels=labels)
    for layer in to_sequential(model, check=False):
        value = layer(value)
    loss = seq2seq_loss(value, labels)
    loss.backward()
    ours = {"logits": value.detach(), "loss": loss.detach()}
    ours |= {f"grad {n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _worst(ours, theirs)


def conform(model_type: str, seq2seq: bool = False) -> Result:
    """The verdict on ``model_type``'s causal-LM class, or with ``seq2seq`` its ``AutoModelForSeq2SeqLM`` class (see
    the module docstring)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    from lightning_gpipe.hf import UnsupportedModelError, check_class

    name = (MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES if seq2seq else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[model_type]
    model_class = getattr(transformers, name)
    start = time.perf_counter()
    try:
        config = tiny_config(model_type)
    except Exception as error:  # transformers' own config: refused before the adapter sees it
        detail = str(error) if isinstance(error, UnsupportedModelError) else f"tiny config: {error!r}"
        return Result(model_type, name, "refused", None, detail, time.perf_counter() - start)
    try:
        family = check_class(model_class, config)
    except UnsupportedModelError as refusal:
        return Result(model_type, name, "refused", None, str(refusal), time.perf_counter() - start)
    if family.encoder or (family.seq2seq and not seq2seq):  # the module for the other kind refuses it
        detail = f"cut as {'an encoder' if family.encoder else 'an encoder-decoder'} by the {family.name} family"
        return Result(model_type, name, "refused", family.name, detail, time.perf_counter() - start)
    try:
        with torch.random.fork_rng():  # a decoder of the seq2seq mapping (Voxtral...): its own causal-LM forward
            tensor, difference = (compare_seq2seq if family.seq2seq else compare)(model_class, config)
    except Exception as error:  # taken, but its cut fails where the self-check ran its forward: wrong
        return Result(model_type, name, "wrong", family.name, f"error: {error!r}", time.perf_counter() - start)
    verdict = "equal" if difference <= TOLERANCE else "wrong"
    detail = f"{tensor}: {difference:.2g}"
    return Result(model_type, name, verdict, family.name, detail, time.perf_counter() - start)


def _own_reason(message: str, seq2seq: bool) -> str:
    """A refusal's reason for the table: with ``seq2seq`` what the encoder-decoder family says of it (the message
    lists every family's; the composite family's for a model that is no encoder-decoder), else the message after the
    class's name."""
    if not seq2seq:
        return message.partition(": ")[2] or message
    own = message.partition("not the encoder-decoder layout: ")[2].split("; and no registered family")[0]
    if "is_encoder_decoder=False" in own and "not the composite layout: " in message:  # a speech-to-text decoder's
        return message.partition("not the composite layout: ")[2].split("; not the ")[0]
    return own or message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="model types (default: every declaring one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--seq2seq", action="store_true", help="every AutoModelForSeq2SeqLM class instead")
    parser.add_argument("--all", action="store_true", help="every causal-LM class, declared plan or not")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    import transformers

    torch.set_num_threads(1)
    listed = seq2seq_types() if args.seq2seq else causal_lm_types() if args.all else declaring_types()
    types = args.only or [model_type for model_type, _ in listed]
    results = []
    print("model_type | class | verdict | family | detail")
    for model_type in types:
        result = conform(model_type, args.seq2seq)
        results.append(result)
        detail = result.detail if result.verdict != "refused" else _own_reason(result.detail, args.seq2seq)[:300]
        print(f"{model_type} | {result.model_class} | {result.verdict} | {result.family} | {detail}", flush=True)
    counts = {verdict: sum(r.verdict == verdict for r in results) for verdict in ("equal", "refused", "wrong")}
    share = counts["equal"] / len(results)
    kind = "seq2seq" if args.seq2seq else "causal-LM" if args.all else "declaring"
    print(f"transformers {transformers.__version__}: {len(results)} {kind} classes, {counts}, {share:.1%} equal")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
