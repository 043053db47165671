"""The shared subword vocabulary of the translation example: its special tokens and how to load it.

One vocabulary serves every language, and a target-language token such as
``<2de>`` in front of the source tells the multilingual model which language to
produce (Johnson et al. 2017, the scheme GPipe's multilingual models use,
Huang et al. 2019, section 5). ``train_tokenizer.py`` learns it;
``tokenizer.json`` next to this file is the shipped result.
"""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

LANGUAGES = ("en", "de", "fr", "cs")
"""The Multi30k languages (ISO 639-1), also the column names of the data files."""

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
"""Padding, unknown, begin-of-sentence and end-of-sentence tokens."""

SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, *(f"<2{language}>" for language in LANGUAGES))
"""Special tokens in id order: padding is id 0, then unknown, begin, end, one ``<2xx>`` per language."""

DEFAULT_TOKENIZER = Path(__file__).resolve().parent / "tokenizer.json"
"""The shipped 8,000-entry BPE vocabulary, learnt from the full Multi30k training text."""


def language_token(language: str) -> str:
    """The target-language token for ``language``, e.g. ``"de"`` -> ``"<2de>"``.

    Raises:
        ValueError: for a language outside :data:`LANGUAGES`.
    """
    if language not in LANGUAGES:
        raise ValueError(f"unknown language {language!r}; expected one of {LANGUAGES}")
    return f"<2{language}>"


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """Load a ``tokenizer.json`` written by ``train_tokenizer.py`` as a ``PreTrainedTokenizerFast``, or the tokenizer
    a Hugging Face model's directory ships (``AutoTokenizer.from_pretrained``, for ``train.py fit
    --model=Seq2SeqTranslation --model.pretrained=DIR``).

    Args:
        path: the file, or a model's directory; default :data:`DEFAULT_TOKENIZER`.

    Raises:
        ValueError: when a special token of :data:`SPECIAL_TOKENS` is missing from a ``tokenizer.json``'s vocabulary.
    """
    if path is not None and Path(path).is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(path or DEFAULT_TOKENIZER), pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS
    )
    vocabulary = tokenizer.get_vocab()
    missing = [token for token in SPECIAL_TOKENS if token not in vocabulary]
    if missing:
        raise ValueError(f"{path}: special tokens {missing} are not in the vocabulary")
    return tokenizer
