"""How a model is told which languages to translate between: the language conventions of each model family.

The example's own Transformer (and any model without a convention of its own: BART, Marian...) reads a
target-language token before the source, ``<2de> A man ...`` (Johnson et al. 2017). A Hugging Face model of a
translation family has its own convention, chosen from its ``model_type``:

- **task prefix** (T5, mT5, umT5, LongT5, Switch): the source is text after ``"translate English to German: "``, the
  prefix T5 was trained with (Raffel et al. 2020, appendix D); the target is the plain sentence.
- **language codes** (M2M100 and NLLB, whose model type is ``m2m_100``; NLLB-MoE; mBART-50): the source starts with
  its language's code and the target with its own (``eng_Latn ... </s>`` to ``deu_Latn ... </s>``; mBART-50's
  ``en_XX``, M2M100's ``__en__``), and generation forces the target's code as the first token
  (``forced_bos_token_id``), as ``transformers``' translation scripts fine-tune them.

The language tokens are the tokenizer's: the first of :data:`SPELLINGS` its vocabulary holds, so the same code runs
with the shipped vocabulary (whose ``<2xx>`` tokens then serve as the codes) and with NLLB's, mBART-50's or
M2M100's.
"""

from typing import Any

from translation.vocabulary import LANGUAGES, language_token

NAMES = {"en": "English", "de": "German", "fr": "French", "cs": "Czech"}
"""The English names of :data:`~translation.vocabulary.LANGUAGES`, as T5's task prefix spells them."""

SPELLINGS = {
    language: (language_token(language), nllb, mbart, f"__{language}__", f">>{iso3}<<")
    for language, nllb, mbart, iso3 in (
        ("en", "eng_Latn", "en_XX", "eng"),
        ("de", "deu_Latn", "de_DE", "deu"),
        ("fr", "fra_Latn", "fr_XX", "fra"),
        ("cs", "ces_Latn", "cs_CZ", "ces"),
    )
}
"""The tokens that name each language, tried in this order: the shipped vocabulary's ``<2xx>``, NLLB's, mBART-50's,
M2M100's and Marian's multilingual models' (``>>deu<<``)."""

PREFIX_TYPES = ("t5", "mt5", "umt5", "longt5", "switch_transformers")
"""Model types told the languages by T5's task prefix."""

CODE_TYPES = ("m2m_100", "nllb-moe", "mbart")
"""Model types told the languages by a code before the source and one forced as the target's first token."""


def layout_of(model_type: str | None) -> str:
    """``"prefix"`` (:data:`PREFIX_TYPES`), ``"codes"`` (:data:`CODE_TYPES`) or ``"tag"`` (any other model type, and
    ``None``: the example's own model)."""
    return "prefix" if model_type in PREFIX_TYPES else "codes" if model_type in CODE_TYPES else "tag"


class Convention:
    """The token ids a model of ``model_type`` reads before and after a sentence, for one direction.

    Args:
        tokenizer: the model's tokenizer (``transformers``), whose vocabulary gives the language tokens.
        model_type: the Hugging Face model type (``"t5"``, ``"m2m_100"``...), or ``None`` for the example's own model.

    Attributes:
        layout: ``"tag"``, ``"prefix"`` or ``"codes"`` (see the module and :func:`layout_of`).
        codes: each language's token id in the vocabulary (the first of :data:`SPELLINGS` it holds), or ``None``.
    """

    def __init__(self, tokenizer: Any, model_type: str | None = None) -> None:
        self.tokenizer, self.model_type, self.layout = tokenizer, model_type, layout_of(model_type)
        vocabulary = tokenizer.get_vocab()
        self.codes = {
            language: next((vocabulary[s] for s in SPELLINGS[language] if s in vocabulary), None)
            for language in LANGUAGES
        }

    def check(self, directions: list[str]) -> None:
        """Refuse directions the tokenizer cannot express.

        Raises:
            ValueError: for the ``"codes"`` layout, when a language of ``directions`` has no token; for the ``"tag"``
                layout, when several target languages are asked for and one of them has no token (a bilingual
                model, such as one of Marian's, translates into its one language without a token).
        """
        pairs = [direction.split("-") for direction in directions]
        needed = {language for pair in pairs for language in pair} if self.layout == "codes" else set()
        targets = {target for _, target in pairs}
        if self.layout == "tag" and len(targets) > 1:
            needed = targets
        missing = sorted(language for language in needed if self.codes[language] is None)
        if missing:
            spellings = ", ".join(" or ".join(SPELLINGS[language]) for language in missing)
            raise ValueError(
                f"{self.model_type or 'the model'} needs a token naming each of the languages {missing} for the"
                f" directions {sorted(directions)}, but the tokenizer has none of {spellings}."
            )

    def source_ends(self, source: str, target: str) -> tuple[list[int], list[int]]:
        """The ids before and after a ``source``-language sentence translated into ``target``: ``([<2de>],
        [</s>])``, the task prefix's ids and ``[</s>]``, or ``([eng_Latn], [</s>])``."""
        end = [self.tokenizer.eos_token_id]
        if self.layout == "prefix":
            prefix = f"translate {NAMES[source]} to {NAMES[target]}:"
            return self.tokenizer(prefix, add_special_tokens=False)["input_ids"], end
        code = self.codes[source if self.layout == "codes" else target]
        return ([] if code is None else [code]), end

    def target_start(self, target: str) -> list[int]:
        """The ids a ``target``-language sentence starts with before its own (``[deu_Latn]`` for language codes;
        none else)."""
        return [self.codes[target]] if self.layout == "codes" else []

    def forced_bos(self, target: str) -> int | None:
        """The id generation forces as the first token of a ``target``-language translation (its code), or
        ``None``."""
        return self.codes[target] if self.layout == "codes" else None
