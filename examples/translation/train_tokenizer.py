"""Train the shared subword vocabulary of the translation example and save ``tokenizer.json``.

Usage (from the repository root)::

    python examples/translation/prepare.py multi30k
    python examples/translation/train_tokenizer.py multi30k/train.jsonl

One byte-pair-encoding vocabulary (Sennrich et al. 2016) is learnt from the
English, German, French and Czech sentences of the training file with Hugging
Face ``tokenizers``, so every direction of the multilingual model shares one
embedding table (GPipe, Huang et al. 2019, section 5: one model for all
languages). Text is NFKC-normalised; words are split on spaces with the
SentencePiece-style ``Metaspace`` marker, so decoding gives the text back.
The special tokens of ``vocabulary.SPECIAL_TOKENS`` come first, in that order.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from datasets import load_dataset
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from translation.vocabulary import DEFAULT_TOKENIZER, LANGUAGES, SPECIAL_TOKENS, UNK


def train_tokenizer(sentences, vocab_size: int = 8000, min_frequency: int = 2) -> Tokenizer:
    """Learn a BPE vocabulary of at most ``vocab_size`` entries (special tokens included) from ``sentences``.

    Args:
        sentences: an iterable of raw sentences.
        vocab_size: size of the vocabulary. Default 8000.
        min_frequency: pairs seen fewer times are not merged. Default 2.
    """
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tokenizer.train_from_iterator(sentences, trainer=trainer)
    return tokenizer


def main() -> None:
    """Parse arguments, train on every language column of the file and write ``tokenizer.json``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("train_file", type=Path, help="JSON Lines file with one column per language (en, de, fr, cs)")
    parser.add_argument("--vocab-size", type=int, default=8000, help="vocabulary size (default 8000)")
    args = parser.parse_args()
    rows = load_dataset("json", data_files=str(args.train_file), split="train")
    sentences = (row[language] for row in rows for language in LANGUAGES)
    tokenizer = train_tokenizer(sentences, vocab_size=args.vocab_size)
    tokenizer.save(str(DEFAULT_TOKENIZER))
    size, languages = tokenizer.get_vocab_size(), len(LANGUAGES)
    print(f"{size} tokens from {len(rows)} rows x {languages} languages -> {DEFAULT_TOKENIZER}")


if __name__ == "__main__":
    main()
