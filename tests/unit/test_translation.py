"""Tests for the translation example (examples/translation): sizes, layer contract, tokenizer, data, decoding.

Parameter counts are checked against GPipe (Huang et al. 2019, arXiv:1811.06965) section 5 on the meta device. The
example on stage processes: tests/distributed/test_translation.py.
"""

import json

import lightning as L
import pytest
import torch
import yaml
from tiny_translation import (
    EXAMPLE,
    TINY,
    LossCurve,
    one_thread,
    predict_data,
    tiny_datamodule,
    tiny_trainer,
    validation_sentences,
)  # fmt: skip
from torch import Tensor
from translation.callbacks import WriteTranslations
from translation.conventions import Convention
from translation.data import DIRECTIONS, TranslationDataModule
from translation.decoding import beam_search, greedy
from translation.model import transformer
from translation.module import DECODING, TranslationModule
from translation.seq2seq import Seq2SeqTranslation
from translation.vocabulary import LANGUAGES, SPECIAL_TOKENS, load_tokenizer


def expected_parameters(
    vocab: int, d: int, ff: int, encoder_layers: int, decoder_layers: int, tied: bool = False
) -> int:
    """Closed-form parameter count of the backbone (weights and biases of every Linear/LayerNorm/attention); with
    ``tied`` tables, the output projection's weight is the embedding's and counts once."""
    attention = 4 * d * d + 4 * d  # query, key, value and output projections
    feed_forward = 2 * d * ff + ff + d
    encoder_layer = attention + feed_forward + 2 * 2 * d  # two LayerNorms
    decoder_layer = 2 * attention + feed_forward + 3 * 2 * d  # three LayerNorms
    embedding, output = vocab * d, 2 * d + d * vocab + vocab
    total = embedding + encoder_layers * encoder_layer + 2 * d + decoder_layers * decoder_layer + output
    return total - vocab * d if tied else total


@pytest.mark.parametrize(("layers", "hidden", "heads", "paper"), [(6, 8192, 16, 400e6), (24, 8192, 16, 1.3e9)])
def test_paper_sizes_match_gpipe_section_5(layers, hidden, heads, paper) -> None:
    """T(L, H, A) with d_model 1024 and GPipe's 64k vocabulary is within 5% of the size the paper reports."""
    with torch.device("meta"):
        model = transformer(64000, 0, 1024, heads, layers, layers, hidden)
    count = sum(parameter.numel() for parameter in model.parameters())
    assert count == expected_parameters(64000, 1024, hidden, layers, layers)
    assert count == pytest.approx(paper, rel=0.05)


CONFIG_PARAMETERS = {
    "cpu.yaml": (2e6, 12e6),
    "multi30k_30min.yaml": (1.9e6, 2e6),  # tied tables
    "t6_8192_16.yaml": (0.28e9, 0.30e9),
    "t24_8192_16.yaml": (1.1e9, 1.2e9),
    "t12_16384_32.yaml": (0.95e9, 1.0e9),
    "t64_16384_32.yaml": (5.1e9, 5.2e9),
}
"""Parameter range of each shipped config with the shipped 8,000-entry vocabulary."""


@pytest.mark.parametrize("config", list(CONFIG_PARAMETERS))
def test_config_parameter_counts_on_the_meta_device(config) -> None:
    """Every config builds on the meta device with the closed-form parameter count, in its documented range."""
    model_args = yaml.safe_load((EXAMPLE / "configs" / config).read_text())["model"]
    with torch.device("meta"):
        module = TranslationModule(**model_args)
    count = sum(parameter.numel() for parameter in module.parameters())
    hp = module.hparams
    assert count == expected_parameters(
        len(module.tokenizer),
        hp.d_model,
        hp.dim_feedforward,
        hp.num_encoder_layers,
        hp.num_decoder_layers,
        hp.tie_embeddings,
    )
    low, high = CONFIG_PARAMETERS[config]
    assert low <= count <= high


def test_layers_carry_tuples_and_masks() -> None:
    """Layer by layer a real batch flows as tuples with the batch in dim 0; decoding is causal; padding is masked."""
    torch.manual_seed(0)
    datamodule = tiny_datamodule()
    datamodule.setup("fit")
    batch = datamodule.train_set[5]
    model = transformer(8000, 0, d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64)
    model.eval()
    activation = (batch["src"], batch["tgt_in"])
    rows = batch["src"].shape[0]
    for name, layer in model.named_children():
        activation = layer(activation)
        items = activation if isinstance(activation, tuple) else (activation,)
        assert all(isinstance(item, Tensor) and item.shape[0] == rows for item in items), name
    assert activation.shape == (*batch["tgt_in"].shape, 8000)
    src, tgt = batch["src"][:2], batch["tgt_in"][:2, :6]
    changed_future = tgt.clone()
    changed_future[:, 4:] = 7
    padded = torch.cat([src, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model((src, tgt))
        torch.testing.assert_close(model((src, changed_future))[:, :4], logits[:, :4])
        torch.testing.assert_close(model((padded, tgt)), logits, atol=1e-5, rtol=1e-5)


def test_the_cooldown_falls_linearly_to_zero_at_max_steps() -> None:
    """Warmup, inverse square root, then over the last ``cooldown_steps`` of ``max_steps`` a linear fall to 0."""
    module = TranslationModule(**{**TINY, "warmup_steps": 4, "cooldown_steps": 10})
    module.trainer = tiny_trainer(max_steps=30)  # as fit sets it
    scheduler = module.configure_optimizers()["lr_scheduler"]["scheduler"]
    factors = [scheduler.lr_lambdas[0](step) for step in range(31)]
    assert factors[3] == 1.0 and factors[15] == pytest.approx((4 / 16) ** 0.5)  # warmup, then 1/sqrt
    assert factors[25] == pytest.approx((4 / 26) ** 0.5 * 0.5) and factors[30] == 0.0  # halfway down, then 0
    with pytest.raises(ValueError, match="needs Trainer\\(max_steps\\)"):
        module.trainer = tiny_trainer(max_steps=-1)
        module.configure_optimizers()


def test_tokenizer_round_trip_and_special_tokens() -> None:
    """The shipped vocabulary decodes what it encodes, in all four languages, with its special tokens in place."""
    tokenizer = load_tokenizer()
    assert len(tokenizer) == 8000
    assert tokenizer.convert_ids_to_tokens(list(range(len(SPECIAL_TOKENS)))) == list(SPECIAL_TOKENS)
    assert tokenizer.pad_token_id == 0
    for language in LANGUAGES:
        for sentence in validation_sentences(language, 50):
            ids = tokenizer(sentence, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == sentence
            assert tokenizer.unk_token_id not in ids or language == "cs"
        tag = tokenizer(f"<2{language}> a", add_special_tokens=False)["input_ids"][0]
        assert tokenizer.convert_ids_to_tokens(tag) == f"<2{language}>"


def test_batches_are_bucketed_and_padded_to_their_longest_pair() -> None:
    """Training batches change shape, stay within max_tokens, and carry the target-language token first."""
    datamodule = tiny_datamodule()
    datamodule.setup("fit")
    tokenizer = datamodule.tokenizer
    shapes = set()
    for batch in datamodule.train_dataloader():
        src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
        shapes.add((tuple(src.shape), tuple(tgt_in.shape)))
        assert src.shape[0] * max(src.shape[1], tgt_in.shape[1]) <= 600 or src.shape[0] == 1
        assert (src[:, -1] != 0).any() and (tgt_out[:, -1] != 0).any()  # padded to the longest, no further
        assert (tgt_in[:, 0] == tokenizer.bos_token_id).all()
        real = tgt_out != 0
        assert torch.equal(tgt_in != 0, real)  # <s> + target and target + </s>: same lengths
        assert torch.equal(tgt_in[:, 1:][real[:, 1:]], tgt_out[:, :-1][real[:, 1:]])  # shifted by one
        assert (tgt_out[torch.arange(len(real)), real.sum(1) - 1] == tokenizer.eos_token_id).all()
        targets = [direction.split("-")[1] for direction in batch["directions"]]
        assert tokenizer.convert_ids_to_tokens(src[:, 0].tolist()) == [f"<2{target}>" for target in targets]
    assert len(shapes) > 20
    assert {d for batch in datamodule.val_dataloader() for d in batch["directions"]} == set(DIRECTIONS)


def word_set(language: str) -> set[str]:
    """Words (lowercased, split on spaces) of ``language`` in the shipped training subset."""
    with open(EXAMPLE / "data" / "train.jsonl", encoding="utf-8") as f:
        return {word for line in f for word in json.loads(line)[language].lower().split()}


@pytest.fixture(scope="module")
def two_directions() -> TranslationModule:
    """The tiny model after 60 single-device steps on en->de and en->fr (lr 1e-2), in evaluation mode."""
    L.seed_everything(0, verbose=False)
    module = TranslationModule(**{**TINY, "lr": 1e-2})
    datamodule = tiny_datamodule(train_directions=["en-de", "en-fr"], max_tokens=800)
    with one_thread():
        tiny_trainer(max_steps=60).fit(module, datamodule)
    return module.eval()


def test_greedy_decode_writes_the_target_language(two_directions) -> None:
    """After 60 single-device steps on en->de and en->fr, ``<2de>`` gives mostly German words, ``<2fr>`` French."""
    german, french = word_set("de"), word_set("fr")
    german, french = german - french, french - german
    for target, own, other in (("de", german, french), ("fr", french, german)):
        words = [word for batch in predict_data(target, 16) for line in two_directions.translate(batch["src"], 1)
                 for word in line.lower().split()]  # fmt: skip
        own_words, other_words = sum(word in own for word in words), sum(word in other for word in words)
        assert own_words >= 20 and own_words > 4 * other_words, (target, words)


def test_cached_decoding_gives_the_tokens_of_uncached_decoding_and_beam_1_is_greedy(two_directions) -> None:
    """The key/value cache changes no token (greedy and beam 4); beam search with one beam is greedy decoding;
    beam 4 finishes some translations earlier than greedy (its length-normalised scores differ)."""
    backbone, tokenizer = two_directions.backbone, two_directions.tokenizer
    ends = dict(bos=tokenizer.bos_token_id, eos=tokenizer.eos_token_id, max_new_tokens=16)
    src = torch.cat([batch["src"] for batch in predict_data("de", 16)])  # one batch of 16, padded
    with torch.no_grad(), one_thread():
        greedy_ids = greedy(backbone, src, cache=True, **ends)
        assert greedy_ids == greedy(backbone, src, cache=False, **ends)
        assert beam_search(backbone, src, beam_size=1, **ends) == greedy_ids
        beam_ids = beam_search(backbone, src, beam_size=4, **ends)
        assert beam_search(backbone, src, beam_size=4, cache=False, **ends) == beam_ids
        assert beam_search(backbone, src[5:6], beam_size=4, **ends) == beam_ids[5:6]  # rows are independent
    assert any(len(b) != len(g) for b, g in zip(beam_ids, greedy_ids))
    assert not set(DECODING) & set(two_directions.hparams)  # chosen when evaluating, not fixed by a checkpoint
    for layer in backbone.modules():  # the caches are freed after decoding
        assert getattr(layer, "cache", None) is None or layer.cache.keys is None


def test_predict_translates_a_file_line_by_line(tmp_path) -> None:
    """``--data.predict_file`` gives the batches of the same sentences as ``predict_sentences``, and
    ``WriteTranslations`` writes ``trainer.predict``'s translations to its file, one line per sentence, in order."""
    sentences = validation_sentences("en", 40)  # two batches: 32 + 8
    source = tmp_path / "sentences.en"
    source.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    from_file = TranslationDataModule(predict_file=str(source)).predict_dataloader()
    from_list = TranslationDataModule(predict_sentences=sentences).predict_dataloader()
    assert [batch["src"].tolist() for batch in from_file] == [batch["src"].tolist() for batch in from_list]
    L.seed_everything(0, verbose=False)
    module = TranslationModule(**{**TINY, "beam_size": 1, "max_new_tokens": 1})
    output = tmp_path / "sentences.de"
    with one_thread():
        predictions = tiny_trainer(callbacks=[WriteTranslations(str(output))]).predict(module, from_file)
    translations = [line for batch in predictions for line in batch]
    assert len(translations) == 40 and output.read_text(encoding="utf-8").splitlines() == translations


def test_prepare_multi30k_turns_the_release_into_the_data_modules_files(tmp_path) -> None:
    """The release's gzipped line-aligned text files (here written from the shipped subset) become JSON Lines rows
    that ``--data.data_dir`` reads, equal to the rows they came from."""
    import gzip

    from translation.prepare import convert

    shipped = {name: [json.loads(line) for line in (EXAMPLE / "data" / f"{name}.jsonl").read_text().splitlines()]
               for name in ("train", "validation")}  # fmt: skip
    expected = {**shipped, "test_2016_flickr": shipped["validation"][:50]}
    raw = tmp_path / "raw"
    raw.mkdir()
    for name, split in (("train", "train"), ("val", "validation"), ("test_2016_flickr", "test_2016_flickr")):
        for language in LANGUAGES:
            lines = "".join(f"{row[language]} \n" for row in expected[split])  # trailing space: stripped
            if split == "validation" and language == "en":
                (raw / f"{name}.{language}").write_text(lines, encoding="utf-8")  # uncompressed is read too
            else:
                with gzip.open(raw / f"{name}.{language}.gz", "wt", encoding="utf-8") as f:
                    f.write(lines)
    assert convert(raw, tmp_path / "out") == {split: len(rows) for split, rows in expected.items()}
    for split, rows in expected.items():
        written = [json.loads(line) for line in (tmp_path / "out" / f"{split}.jsonl").read_text().splitlines()]
        assert written == [{"id": i, **{lang: row[lang] for lang in LANGUAGES}} for i, row in enumerate(rows)]
    datamodule = tiny_datamodule(data_dir=str(tmp_path / "out"), val_split="test_2016_flickr", val_rows=None)
    datamodule.setup("fit")
    assert len(datamodule.train_set) > 0 and sum(len(b) for b in datamodule.val_set.batches) == 50 * len(DIRECTIONS)
    (raw / "val.fr.gz").write_bytes(gzip.compress(b"one line\n"))
    with pytest.raises(ValueError, match="val: the languages have different numbers of lines"):
        convert(raw, tmp_path / "again")


def test_prepare_downloads_the_release_and_a_hub_shaped_directory_trains_its_directions(tmp_path) -> None:
    """``prepare.py DIR`` downloads the twelve release files (here from a ``file://`` copy) and writes the JSON
    Lines files; data with English and German only (like ``bentrevett/multi30k``, whose test split is ``test``)
    trains en-de and de-en by default and finds ``test_2016_flickr`` under ``test``; a missing directory or a
    failed download stops with the flag and the prepare command."""
    import gzip

    from example_data import DataUnavailableError
    from translation.prepare import main as prepare

    rows = [json.loads(line) for line in (EXAMPLE / "data" / "validation.jsonl").read_text().splitlines()][:30]
    raw = tmp_path / "raw"
    raw.mkdir()
    for name in ("train", "val", "test_2016_flickr"):
        for language in LANGUAGES:
            (raw / f"{name}.{language}.gz").write_bytes(
                gzip.compress("".join(r[language] + "\n" for r in rows).encode())
            )
    prepare([str(tmp_path / "out"), f"--base-url={raw.as_uri()}"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "test_2016_flickr.jsonl", "train.jsonl", "validation.jsonl"
    ]  # fmt: skip
    with pytest.raises(SystemExit, match=r"could not download (.|\n)*needs network; the machine may be offline"):
        prepare([str(tmp_path / "again"), f"--base-url={(tmp_path / 'nowhere').as_uri()}"])
    hub_like = tmp_path / "hub_like"
    hub_like.mkdir()
    for split in ("train", "validation", "test"):
        lines = [json.dumps({"en": r["en"], "de": r["de"]}) for r in rows]
        (hub_like / f"{split}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    datamodule = tiny_datamodule(
        data_dir=str(hub_like), dataset_name="bentrevett/multi30k", val_split="test_2016_flickr"
    )
    datamodule.check_data("validate")  # data_dir wins over dataset_name; test_2016_flickr is found as test.jsonl
    datamodule.setup("fit")
    assert {pair.direction for batch in datamodule.train_set.batches for pair in batch} == {"en-de", "de-en"}
    with pytest.raises(
        DataUnavailableError, match=r"--data.data_dir=.*does not exist(.|\n)*translation/prepare.py DIR"
    ):
        tiny_datamodule(data_dir=str(tmp_path / "missing")).check_data("fit")
    tiny_datamodule(data_dir=str(tmp_path / "missing")).check_data("predict")  # predict reads its own sentences


T5_TINY = dict(
    model_type="t5", d_model=32, d_ff=48, d_kv=8, num_heads=2, num_layers=2, num_decoder_layers=2,
    feed_forward_proj="gated-gelu", dropout_rate=0.0,
)  # fmt: skip
"""A T5 small enough for a test (Flan-T5's gated feed-forward), trained from scratch with the shipped tokenizer."""


def test_a_seq2seq_config_trains_from_scratch_with_the_shipped_tokenizer_and_t5s_task_prefix() -> None:
    """``Seq2SeqTranslation(config=...)`` (``lightning_gpipe.hf.Seq2SeqLM``) reads the shipped vocabulary's ids; the
    data module in T5's convention writes "translate English to German: ..." sources; 3 steps train and a validation
    decodes through ``Seq2SeqLM.generate`` and logs the example's SacreBLEU per direction."""
    L.seed_everything(0, verbose=False)
    with one_thread():  # the self-check on a miniature
        module = Seq2SeqTranslation(config=T5_TINY, attn_implementation="eager", lr=3e-3, max_new_tokens=1)
    tokenizer = module.tokenizer
    config = module.hf_config()
    assert (config.vocab_size, config.pad_token_id, config.eos_token_id) == (8000, 0, 3)
    assert config.decoder_start_token_id == tokenizer.bos_token_id and module.convention.layout == "prefix"
    datamodule = tiny_datamodule(
        model_type="t5", train_split="validation", train_directions=["en-de", "fr-en"], val_directions=["en-de"],
        val_rows=2,
    )  # fmt: skip
    curve = LossCurve()
    trainer = tiny_trainer(max_steps=3, limit_val_batches=1, val_check_interval=3, callbacks=[curve])
    with one_thread():
        trainer.fit(module, datamodule)
    sources = {tokenizer.decode(pair.source) for batch in datamodule.train_set.batches for pair in batch}
    assert {s.split(":")[0] for s in sources} == {"translate English to German", "translate French to English"}
    assert all(s.endswith("</s>") and "<2" not in s for s in sources)
    assert len(curve.losses) == 3 and all(0 < loss < 20 for loss in curve.losses)
    bleu = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_bleu_")}
    assert bleu and all(0 <= value <= 100 for value in bleu.values()) and "val_loss" in trainer.callback_metrics


def tiny_nllb(directory) -> int:
    """Save an M2M100 miniature (NLLB's class) with a character-level NLLB tokenizer (its 202 language codes) to
    ``directory``; return the tokenizer's size."""
    import string

    from hf_families import build
    from transformers import NllbTokenizer

    pieces = ["<s>", "<pad>", "</s>", "<unk>", "\u2581", *string.ascii_letters, *".,'-"]
    tokenizer = NllbTokenizer(vocab={piece: i for i, piece in enumerate(pieces)}, merges=[])
    torch.manual_seed(0)
    build("m2m_100", vocab_size=len(tokenizer), max_position_embeddings=256).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return len(tokenizer)


def test_a_pretrained_directory_brings_its_tokenizer_and_nllb_language_codes_forced_per_row(
    tmp_path, monkeypatch
) -> None:
    """From a saved directory (an M2M100 miniature and its NLLB tokenizer), through ``train.py``'s command line:
    the data module uses the directory's tokenizer, sources start with ``eng_Latn``, targets with their own code,
    the loss runs, and each row's translation starts with its target's code (forced per row in a mixed batch)."""
    import sys

    import translation.train as train

    monkeypatch.setattr(sys, "argv", ["train.py"])

    size = tiny_nllb(tmp_path)
    argv = [
        "--model=Seq2SeqTranslation", f"--model.pretrained={tmp_path}", "--model.max_new_tokens=1",
        "--model.attn_implementation=eager", "--data.val_rows=2", "--data.val_directions=[en-de,en-fr]",
    ]  # fmt: skip
    with one_thread():  # the self-check on a miniature
        cli = train.main(argv, run=False)
    module, datamodule = cli.model, cli.datamodule
    assert isinstance(module, Seq2SeqTranslation) and module.model_type == "m2m_100"
    assert len(datamodule.tokenizer) == size and datamodule.convention.layout == "codes"
    code = {language: datamodule.tokenizer.convert_tokens_to_ids(name)
            for language, name in (("en", "eng_Latn"), ("de", "deu_Latn"), ("fr", "fra_Latn"))}  # fmt: skip
    module.configure_model()
    datamodule.setup("validate")
    batch = datamodule.val_set[0]
    assert (batch["src"][:, 0] == code["en"]).all()
    assert batch["tgt_out"][:, 0].tolist() == [code[d.split("-")[1]] for d in batch["directions"]]
    with torch.no_grad(), one_thread():
        loss = module.cross_entropy(module.target_logits(batch), batch["tgt_out"])
    assert 0 < float(loss) < 20
    de, fr = (
        next(iter(TranslationDataModule(tokenizer_file=str(tmp_path), model_type="m2m_100",
                                        predict_sentences=["A dog runs."], predict_target=t).predict_dataloader()))
        for t in ("de", "fr")
    )  # fmt: skip
    mixed = {"src": torch.cat([de["src"], fr["src"], de["src"]]), "directions": ["en-de", "en-fr", "en-de"]}
    with one_thread():
        ids = module.eval().translation_ids(mixed)
    assert [row[0] for row in ids] == [code["de"], code["fr"], code["de"]] and len(ids[0]) > 1
    assert module.hf_model.generation_config.forced_bos_token_id is None  # restored after decoding


def test_each_model_types_language_convention_around_a_sentence() -> None:
    """T5's task prefix, mBART-50's codes (the target's forced first), the example's ``<2de>`` (also the codes of an
    NLLB config trained with the shipped tokenizer); a direction a tokenizer cannot name is refused, except the one
    target language of a bilingual model."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    shipped = load_tokenizer()
    t5, own = Convention(shipped, "t5"), Convention(shipped)
    eos = [shipped.eos_token_id]
    head, tail = t5.source_ends("fr", "cs")
    assert shipped.decode(head) == "translate French to Czech:" and tail == eos
    assert t5.target_start("cs") == [] and t5.forced_bos("cs") is None
    assert own.source_ends("en", "de") == ([shipped.convert_tokens_to_ids("<2de>")], eos)
    assert own.target_start("de") == [] and own.forced_bos("de") is None
    assert Convention(shipped, "m2m_100").source_ends("fr", "en")[0] == [shipped.convert_tokens_to_ids("<2fr>")]
    words = models.WordLevel({"<unk>": 0, "</s>": 1, "en_XX": 2, "de_DE": 3}, unk_token="<unk>")
    bare = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(words), eos_token="</s>", unk_token="<unk>")
    mbart = Convention(bare, "mbart")
    assert (
        mbart.source_ends("en", "de") == ([2], [1]) and mbart.target_start("de") == [3] and mbart.forced_bos("de") == 3
    )
    mbart.check(["en-de", "de-en"])
    with pytest.raises(ValueError, match=r"mbart needs a token naming each of the languages \['fr'\]"):
        mbart.check(["en-fr"])
    with pytest.raises(ValueError, match="none of <2fr> or fra_Latn or fr_XX or __fr__ or >>fra<<"):
        Convention(bare, "bart").check(["en-de", "en-fr"])  # BART: a target-language token, none for French
    Convention(bare, "bart").check(["en-fr", "de-fr"])  # one target language: a bilingual model needs none
