"""A Hugging Face encoder-decoder in place of the example's Transformer: ``train.py fit --model=Seq2SeqTranslation``.

:class:`Seq2SeqTranslation` is ``lightning_gpipe.hf.Seq2SeqLM`` (any ``AutoModelForSeq2SeqLM`` of the encoder-decoder
layout: T5, mT5, BART, mBART, Marian, M2M100/NLLB...) trained on the example's batches and scored by the example's
code (:class:`~translation.scoring.Translator`): the same SacreBLEU on the same splits as the example's own model. It
starts from a local pretrained directory, with the tokenizer it ships, or from a config trained from scratch with the
example's tokenizer; the batches follow the model's language convention (:mod:`translation.conventions`).
"""

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig

from lightning_gpipe.hf import Seq2SeqLM
from translation.conventions import Convention
from translation.scoring import Translator
from translation.vocabulary import load_tokenizer


def config_fields(config: str | dict) -> dict:
    """The fields of a model config given as a dict, a JSON file or a model type: ``{"model_type": "t5", ...}``.

    Args:
        config: a dict with a ``model_type`` key, the path of a JSON file holding one (a ``config.json``), or a
            model type alone (``"t5"``: that type's default config).

    Raises:
        ValueError: when the dict or the file has no ``model_type``.
    """
    if isinstance(config, str):
        config = json.loads(Path(config).read_text()) if config.endswith(".json") else {"model_type": config}
    fields = dict(config)
    if "model_type" not in fields:
        raise ValueError(f"the model config {config} has no model_type (e.g. 't5', 'bart', 'm2m_100')")
    return fields


def model_type_of(pretrained: str | None, config: str | dict | None) -> str:
    """The model type of ``pretrained``'s config (``transformers.AutoConfig``), else of ``config``
    (:func:`config_fields`)."""
    if pretrained is not None:
        return AutoConfig.from_pretrained(pretrained).model_type
    return config_fields(config or {})["model_type"]


def tokenizer_fields(tokenizer: Any) -> dict:
    """The config fields that make a new model read ``tokenizer``'s ids: its vocabulary size, its padding, end and
    begin ids, and the decoder's start (the begin id, or the padding id where there is none)."""
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    return {
        "vocab_size": len(tokenizer),
        "pad_token_id": pad,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": bos,
        "decoder_start_token_id": pad if bos is None else bos,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
    }


class Seq2SeqTranslation(Translator, Seq2SeqLM):
    """A Hugging Face encoder-decoder fine-tuned, or trained from a config, on the example's batches.

    Training is ``Seq2SeqLM``'s (its backbone, the model's own loss with ``label_smoothing``, AdamW with warmup and
    decay); validation and ``predict`` are the example's (:class:`~translation.scoring.Translator`), decoding greedily
    through the pipeline with ``Seq2SeqLM.generate`` and the model's generation config, the target's language code
    forced first for NLLB, M2M100 and mBART-50 (:meth:`~translation.conventions.Convention.forced_bos`).

    Args:
        pretrained: a local ``save_pretrained`` directory holding the model and its tokenizer (or a Hub name, on a
            machine that reaches the Hub); ``None`` to train ``config`` from scratch.
        config: the model's config when ``pretrained`` is ``None``: a dict with ``model_type``, a JSON file, or a
            model type (``"t5"``: its default sizes); see :func:`config_fields`. Its vocabulary and special ids are
            set from the tokenizer (:func:`tokenizer_fields`).
        tokenizer_file: the tokenizer: ``None`` (default) is the pretrained directory's, else the example's shipped
            ``tokenizer.json`` (``train.py`` links it to ``--data.tokenizer_file``).
        label_smoothing: of the training loss. Default 0.1, as the example's model.
        max_new_tokens: decoding stops after ``S + max_new_tokens`` tokens for sources of S tokens. Default 16.
        decode: translate the validation batches and log SacreBLEU per direction. Default True.
        **kwargs: ``Seq2SeqLM``'s: ``lr``, ``warmup_steps``, ``decay``, ``overrides``, ``lora``...

    Raises:
        ValueError: neither ``pretrained`` nor ``config``; a config without ``model_type``.
        lightning_gpipe.hf.UnsupportedModelError: a model ``Seq2SeqLM`` does not train (raised before any process
            starts).
    """

    def __init__(
        self,
        pretrained: str | None = None,
        config: str | dict | None = None,
        tokenizer_file: str | None = None,
        label_smoothing: float = 0.1,
        max_new_tokens: int = 16,
        decode: bool = True,
        **kwargs: Any,
    ) -> None:
        if pretrained is None and config is None:
            raise ValueError("Give --model.pretrained (a model's directory) or --model.config (a config to train).")
        tokenizer = load_tokenizer(tokenizer_file or pretrained)
        fields = None if pretrained is not None else {**config_fields(config), **tokenizer_fields(tokenizer)}
        super().__init__(
            pretrained=pretrained,
            config=fields,
            label_smoothing=label_smoothing,
            max_new_tokens=max_new_tokens,
            **kwargs,
        )
        self.tokenizer, self.pad_id, self.decode = tokenizer, tokenizer.pad_token_id, decode
        self.model_type = model_type_of(pretrained, config)
        self.convention = Convention(tokenizer, self.model_type)
        self.add_metrics()

    def hf_batch(self, batch: dict) -> dict:
        """The example's batch as ``Seq2SeqLM`` takes it: ``input_ids`` (``src``), ``attention_mask``, ``labels``
        (``tgt_out``, ``-100`` at padding: the model shifts them right after its decoder start) and
        ``decoder_attention_mask``."""
        src, tgt_out = batch["src"], batch["tgt_out"]
        real = tgt_out != self.pad_id
        return {
            "input_ids": src,
            "attention_mask": (src != self.pad_id).long(),
            "labels": tgt_out.masked_fill(~real, -100),
            "decoder_attention_mask": real.long(),
        }

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """``Seq2SeqLM``'s step on :meth:`hf_batch`: the label-smoothed loss, logged as ``train_loss``."""
        return super().training_step(self.hf_batch(batch), batch_idx)

    def target_logits(self, batch: dict) -> Tensor:
        """The backbone's ``(N, T, vocab)`` logits of :meth:`hf_batch`."""
        return self.backbone(self.backbone_input(self.hf_batch(batch)))

    @torch.no_grad()
    def translation_ids(self, batch: dict) -> list[list[int]]:
        """Greedy translations of ``batch["src"]`` through the pipeline, as the new ids of each row (its forced
        language code first, where the convention forces one), one ``Seq2SeqLM.generate`` call per target language of
        ``batch["directions"]`` when the model is told it by a forced first token, else one for the whole batch;
        call it on every stage."""
        src = batch["src"]
        mask = (src != self.pad_id).long()
        targets = [direction.split("-")[1] for direction in batch["directions"]]
        groups = sorted(set(targets)) if self.convention.layout == "codes" else [None]
        generation = self.hf_model.generation_config
        forced, ids = generation.forced_bos_token_id, [[] for _ in targets]
        for language in groups:  # the same order on every stage
            rows = [i for i, target in enumerate(targets) if language in (None, target)]
            generation.forced_bos_token_id = forced if language is None else self.convention.forced_bos(language)
            out = self.generate(src[rows], mask[rows], src.shape[1] + self.max_new_tokens)
            for row, new in zip(rows, out[:, 1:].tolist(), strict=True):
                ids[row] = new
        generation.forced_bos_token_id = forced
        return ids

    def translate_batch(self, batch: dict) -> list[str]:
        """The detokenized :meth:`translation_ids` (special tokens dropped: language codes, end, padding)."""
        return self.tokenizer.batch_decode(self.translation_ids(batch), skip_special_tokens=True)
