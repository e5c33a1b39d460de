"""label_model: the label read from a judge's answer."""

from __future__ import annotations

import pytest

from core.graders.judge import JudgeError
from core.graders.label import LabelModelGrader, label_of

LABELS = ["positive", "negative", "neutral"]


@pytest.mark.parametrize("answer", ["positive", " Positive. ", '"positive"',
                                    '{"label": "positive"}', "I would say positive here"])
def test_the_label_is_read_from_the_answer(answer: str) -> None:
    assert label_of(answer, LABELS) == "positive"


def test_an_answer_naming_no_label_is_the_graders_error() -> None:
    with pytest.raises(JudgeError, match="names no label"):
        label_of("cheerful", LABELS)


def test_an_answer_naming_two_labels_is_the_graders_error() -> None:
    with pytest.raises(JudgeError, match="names several labels"):
        label_of("positive or negative", LABELS)


def test_passing_labels_must_be_labels() -> None:
    with pytest.raises(ValueError, match="not among labels"):
        LabelModelGrader(name="t", model="judge", input=[{"role": "user", "content": "x"}],
                         labels=["a", "b"], passing_labels=["c"])
