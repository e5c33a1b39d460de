"""format auto: which layout the rows hold, the receipt, and the refusals that name what
was found and what came close."""

from __future__ import annotations

from typing import Any

import pytest

from core.data.formats import allowed_formats, resolve
from core.data.formats.detect import FormatError
from core.spec import DatasetSpec
from tests.utils import samples

SFT = allowed_formats("causal_lm", "sft")


def detect(row: dict[str, Any], allowed: tuple[str, ...] = SFT, **ds: Any) -> tuple[str, str]:
    res = resolve(DatasetSpec(file_id="f", **ds), allowed, list(row), [row])
    return res.layout.format, res.layout.name


@pytest.mark.parametrize(
    ("row", "allowed", "want"),
    [
        ({"text": "a"}, SFT, ("text", "text")),
        ({"prompt": "a", "completion": "b"}, SFT, ("prompt_completion", "prompt_completion")),
        (samples.OPENAI_TOOLS, SFT, ("chat", "openai_chat")),
        (samples.ALPACA[1], SFT, ("alpaca", "alpaca")),
        (samples.SHAREGPT_TOOLS, SFT, ("sharegpt", "sharegpt")),
        (samples.OPENAI_DPO, ("preference",), ("preference", "openai_dpo")),
        (samples.SHAREGPT_DPO, ("preference",), ("preference", "sharegpt_preference")),
        (samples.TRL_PAIR, ("preference",), ("preference", "trl_preference")),
        (samples.TRL_IMPLICIT, ("preference",), ("preference", "trl_implicit_preference")),
        (samples.KTO_MESSAGES, ("kto",), ("kto", "kto_messages")),
        ({"prompt": "a", "completion": "b", "label": True}, ("kto",), ("kto", "kto")),
        ({"text": "a", "label": "x"}, allowed_formats("seq_cls", "sft"),
         ("classification", "classification")),
    ],
)
def test_each_layout_is_detected(row: dict[str, Any], allowed: tuple[str, ...], want: Any) -> None:
    assert detect(row, allowed) == want


def test_receipt_says_what_was_used_and_ignored() -> None:
    row = samples.OPENAI_TOOLS
    res = resolve(DatasetSpec(file_id="f"), SFT, list(row), [row])
    assert res.receipt(list(row)).to_dict() == {
        "format": "chat",
        "layout": "openai_chat",
        "detected": True,
        "columns_used": {"messages": "messages", "tools": "tools"},
        "columns_ignored": ["parallel_tool_calls"],
        "rows": 0,
    }


def test_ambiguous_columns_are_refused_naming_both() -> None:
    row = {"text": "a", "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(FormatError) as e:
        detect(row)
    assert str(e.value) == (
        "the columns fit more than one format: text (text) and openai_chat (messages); the "
        "rows have text, messages. Set dataset.format (and dataset.columns) to say which"
    )


def test_no_match_names_the_columns_and_what_came_close() -> None:
    with pytest.raises(FormatError) as e:
        detect({"question": "q", "answer": "a", "output": "o"})
    assert str(e.value).startswith(
        "no data format matches the columns found (question, answer, output); closest: "
        "alpaca (missing 'instruction')"
    )


def test_columns_mapping_makes_a_renamed_file_match() -> None:
    row = {"question": "q", "answer": "a"}
    assert detect(row, columns={"prompt": "question", "response": "answer"}) == ("alpaca", "alpaca")
