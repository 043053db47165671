"""The shared subword vocabulary of the translation example: its special tokens and how to load it.

One vocabulary serves every language, and a target-language token such as
``<2de>`` in front of the source tells the multilingual model which language to
produce (Johnson et al. 2017, the scheme GPipe's multilingual models use,
Huang et al. 2019, section 5). ``train_tokenizer.py`` learns it;
``tokenizer.json`` next to this file is the shipped result.
"""

from pathlib import Path

from transformers import PreTrainedTokenizerFast

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


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Load a ``tokenizer.json`` written by ``train_tokenizer.py`` as a ``PreTrainedTokenizerFast``.

    Args:
        path: the file; default :data:`DEFAULT_TOKENIZER`.

    Raises:
        ValueError: when a special token of :data:`SPECIAL_TOKENS` is missing from the vocabulary.
    """
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(path or DEFAULT_TOKENIZER), pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS
    )
    vocabulary = tokenizer.get_vocab()
    missing = [token for token in SPECIAL_TOKENS if token not in vocabulary]
    if missing:
        raise ValueError(f"{path}: special tokens {missing} are not in the vocabulary")
    return tokenizer
