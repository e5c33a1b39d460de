"""string_check and text_similarity: pure functions of two strings.

The similarity metrics come from well-kept libraries (pip extra ``grpo``): rapidfuzz
(fuzzy_match: its normalised Indel ratio), nltk (bleu, gleu, meteor: sentence-level, on
whitespace tokens, BLEU with smoothing method 1 so a short answer with no 4-gram match is
not zero outright), rouge-score (rouge_1..5, rouge_l: the F1 of the n-gram / longest common
subsequence overlap). Each returns a float in [0, 1].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def string_check(operation: str, text: str, reference: str) -> float:
    if operation == "eq":
        return float(text == reference)
    if operation == "ne":
        return float(text != reference)
    if operation == "like":
        return float(reference in text)
    if operation == "ilike":
        return float(reference.casefold() in text.casefold())
    raise ValueError(f"unknown operation {operation!r}")


def similarity_installed() -> bool:
    try:
        import nltk  # noqa: F401
        import rapidfuzz  # noqa: F401
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def meteor_available() -> bool:
    """METEOR matches synonyms through WordNet, a corpus nltk downloads at run time (no
    network here): only when the operator installed nltk_data with wordnet."""
    try:
        import nltk

        nltk.data.find("corpora/wordnet")
    except (ImportError, LookupError):
        return False
    return True


def similarity(metric: str, text: str, reference: str) -> float:
    return _METRICS[metric](text, reference)


def _fuzzy(text: str, reference: str) -> float:
    from rapidfuzz import fuzz

    return float(fuzz.ratio(text, reference)) / 100.0


def _tokens(text: str) -> list[str]:
    return text.split()


def _bleu(text: str, reference: str) -> float:
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    hyp, ref = _tokens(text), _tokens(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    return float(sentence_bleu([ref], hyp, smoothing_function=SmoothingFunction().method1))


def _gleu(text: str, reference: str) -> float:
    from nltk.translate.gleu_score import sentence_gleu

    hyp, ref = _tokens(text), _tokens(reference)
    if not hyp or not ref:
        return float(hyp == ref)
    return float(sentence_gleu([ref], hyp))


def _meteor(text: str, reference: str) -> float:
    from nltk.translate.meteor_score import meteor_score

    return float(meteor_score([_tokens(reference)], _tokens(text)))


@functools.cache
def _rouge(kind: str) -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer([kind])


def _rouge_metric(kind: str) -> Callable[[str, str], float]:
    def score(text: str, reference: str) -> float:
        return float(_rouge(kind).score(reference, text)[kind].fmeasure)

    return score


_METRICS: dict[str, Callable[[str, str], float]] = {
    "fuzzy_match": _fuzzy,
    "bleu": _bleu,
    "gleu": _gleu,
    "meteor": _meteor,
    **{f"rouge_{n}": _rouge_metric(f"rouge{n}") for n in range(1, 6)},
    "rouge_l": _rouge_metric("rougeL"),
}
