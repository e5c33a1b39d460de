"""Chat: every assistant turn ends with EOS, and the EOS is learned (its label is kept)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.data.tokenize import IGNORE_INDEX, tokenize_rows
from core.spec import parse_job_spec
from tests.utils.tiny import CHAT_TEMPLATE

MESSAGES = [
    {"role": "user", "content": "the cat"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "the dog"},
    {"role": "assistant", "content": "no"},
]
SPEC = parse_job_spec(
    {"model": {"name_or_path": "/m"}, "dataset": {"path": "/d.jsonl", "format": "chat"}}
)


@pytest.fixture(scope="module")
def tok(tiny_causal_lm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_causal_lm)


def _learned_turns(tok: Any, ex: dict[str, Any]) -> list[list[int]]:
    """Runs of consecutive learned tokens (one per assistant turn)."""
    turns: list[list[int]] = []
    previous = IGNORE_INDEX
    for label in ex["labels"]:
        if label != IGNORE_INDEX:
            if previous == IGNORE_INDEX:
                turns.append([])
            turns[-1].append(label)
        previous = label
    return turns


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "per-turn"])
def test_each_assistant_turn_ends_with_a_learned_eos(tok: Any, markers: bool) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    if not markers:
        t.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""
        )
    ex = tokenize_rows(SPEC, t, [{"messages": MESSAGES}])[0]
    turns = _learned_turns(t, ex)
    assert len(turns) == 2
    assert all(turn[-1] == t.eos_token_id for turn in turns)
    assert ex["input_ids"].count(t.eos_token_id) == 2  # the template's own: nothing added


def test_eos_is_added_where_the_template_writes_none(tok: Any) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    # A template that ends assistant turns with nothing: the model would never learn to stop.
    t.chat_template = CHAT_TEMPLATE.replace("{{ eos_token }}", "")
    ex = tokenize_rows(SPEC, t, [{"messages": MESSAGES}])[0]
    turns = _learned_turns(t, ex)
    assert [t.decode(turn) for turn in turns] == ["<|assistant|>yes</s>", "<|assistant|>no</s>"]
    # Inserted right after each turn, before the next user turn.
    user = t.convert_tokens_to_ids("<|user|>")
    i = ex["input_ids"].index(t.eos_token_id)
    assert ex["input_ids"][i + 1] == user


def test_a_turn_ending_in_eos_then_newline_gets_no_second_eos(tok: Any) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok.name_or_path)
    t.chat_template = (
        CHAT_TEMPLATE.replace("{% generation %}", "")
        .replace("{% endgeneration %}", "")
        .replace("{{ eos_token }}", "{{ eos_token }}\n")
    )
    ex = tokenize_rows(SPEC, t, [{"messages": MESSAGES}])[0]
    assert ex["input_ids"].count(t.eos_token_id) == 2
    assert all(t.eos_token_id in turn for turn in _learned_turns(t, ex))
