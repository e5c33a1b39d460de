"""What each data format trains on, token by token: exact loss-token counts on the tiny
tokenizer against counts worked out by hand from its template.

The tiny template writes an assistant turn as ``<|assistant|>{content}</s>`` inside
{% generation %}: a learned turn carries 1 + tokens(content) + 1 loss tokens. The named
chatml template has no generation markers, so its spans come from rendering prefixes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from core.data.datasets import build_datasets
from core.data.tokenize import IGNORE_INDEX, tokenize_rows
from core.infra.errors import TrainFailure
from core.spec import JobSpec
from tests.utils import samples
from tests.utils.specs import spec_body
from tests.utils.tiny import build_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def spec(**dataset: Any) -> JobSpec:
    return JobSpec.model_validate(
        spec_body("m", dataset={"path": "d", "max_seq_length": 1024, **dataset}))


def n(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def loss_tokens(tok: Any, rows: list[dict[str, Any]], **dataset: Any) -> int:
    return tokenize_rows(spec(**dataset), tok, rows).stats.loss_tokens


def learned(example: dict[str, Any]) -> list[int]:
    return [t for t, lab in zip(example["input_ids"], example["labels"]) if lab != IGNORE_INDEX]


def ids(tok: Any, text: str) -> list[int]:
    """The tiny vocabulary lacks capitals and most punctuation (they decode as <unk>):
    compare token ids, not decoded text."""
    return list(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def chatml(tok: Any) -> Any:
    from core.spec.chat_templates import CHATML

    return _with_template(tok, CHATML)


def test_weight_0_turn_carries_no_loss(tok: Any) -> None:
    last = samples.OPENAI_WEIGHTED["messages"][4]["content"]
    first = samples.OPENAI_WEIGHTED["messages"][2]["content"]
    assert loss_tokens(tok, [samples.OPENAI_WEIGHTED]) == 2 + n(tok, last)
    # Without the weights both answers are learned.
    both = loss_tokens(tok, [samples.unweighted(samples.OPENAI_WEIGHTED)])
    assert both == 2 + n(tok, last) + 2 + n(tok, first)


def test_weight_0_turn_carries_no_loss_with_prefix_rendering(chatml: Any) -> None:
    """chatml has no generation markers: the spans come from rendering prefixes, and the
    weight-0 turn is still context only."""
    ex = tokenize_rows(spec(chat_template="chatml"), chatml, [samples.OPENAI_WEIGHTED])[0]
    last = samples.OPENAI_WEIGHTED["messages"][4]["content"]
    # The turn, its end-of-turn marker and newline, then the EOS ftune adds to learn to stop.
    assert learned(ex) == ids(chatml, f"{last}<|im_end|>\n") + [chatml.eos_token_id]


def test_tools_are_rendered_through_the_template(chatml: Any) -> None:
    ex = tokenize_rows(spec(chat_template="chatml"), chatml, [samples.OPENAI_TOOLS])[0]
    tool = json.dumps(samples.WEATHER_TOOL)
    call = json.dumps({"name": "get_current_weather",
                       "arguments": {"location": "San Francisco, USA", "format": "celsius"}})
    answer = "It is 18 degrees celsius in San Francisco."
    system = f"<|im_start|>system\n# Tools\n\n<tools>\n{tool}\n</tools><|im_end|>\n"
    assert ex["input_ids"][: len(ids(chatml, system))] == ids(chatml, system)
    # The tool call is learned, as JSON with its arguments; the tool's answer is not.
    eos = [chatml.eos_token_id]
    assert learned(ex) == (
        ids(chatml, f"<tool_call>\n{call}\n</tool_call><|im_end|>\n") + eos
        + ids(chatml, f"{answer}<|im_end|>\n") + eos
    )


def test_alpaca_input_changes_the_prompt_not_the_loss(tok: Any) -> None:
    with_input = samples.ALPACA[1]
    without = {**with_input, "input": ""}
    a, b = (tokenize_rows(spec(format="alpaca"), tok, [r]) for r in (with_input, without))
    assert a.stats.loss_tokens == b.stats.loss_tokens == 2 + n(tok, "Telegram")
    joined = "Identify the odd one out.\nTwitter, Instagram, Telegram"
    assert a.stats.tokens - b.stats.tokens == (
        n(tok, joined) - n(tok, "Identify the odd one out.")
    )


def test_sharegpt_learns_the_call_and_the_answer(chatml: Any) -> None:
    ex = tokenize_rows(spec(chat_template="chatml"), chatml, [samples.SHAREGPT_TOOLS])[0]
    call = json.dumps({"name": "convert_currency",
                       "arguments": {"amount": 500, "from_currency": "USD", "to_currency": "EUR"}})
    answer = "Sure, 500 US dollars is approximately 425.50 Euros."
    eos = [chatml.eos_token_id]
    # The observation (the tool's answer) is context only.
    assert learned(ex) == (
        ids(chatml, f"<tool_call>\n{call}\n</tool_call><|im_end|>\n") + eos
        + ids(chatml, f"{answer}<|im_end|>\n") + eos
    )


# Drops an assistant answer that holds "!" (as some templates drop what they do not
# expect, e.g. tool calls): the spec's check renders a plain answer and accepts it.
DROPS_EXCLAIMED = (
    "{% for m in messages %}{% if m['role'] != 'assistant' or '!' not in m['content'] %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}{% endfor %}"
)


def exclaimed() -> dict[str, Any]:
    row = copy.deepcopy(samples.OPENAI_PARTS)
    row["messages"][1]["content"] = "Four!"
    return row


def test_a_template_that_drops_the_answer_fails_naming_rows(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [samples.OPENAI_PARTS] + [exclaimed()] * 2)
    s = spec(path=str(path), chat_template=DROPS_EXCLAIMED)
    with pytest.raises(TrainFailure) as e:
        build_datasets(s, path, None, _with_template(tok, DROPS_EXCLAIMED))
    assert "2 training row(s) have no token to learn once rendered (rows 2, 3)" in str(e.value)


def test_rows_without_loss_are_skipped_and_counted_when_allowed(tok: Any, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [exclaimed(), samples.OPENAI_PARTS])
    s = spec(path=str(path), chat_template=DROPS_EXCLAIMED, skip_rows_without_loss=True)
    data = build_datasets(s, path, None, _with_template(tok, DROPS_EXCLAIMED))
    assert (data.train.stats.rows, data.train.stats.examples) == (2, 1)
    assert data.receipt is not None
    assert (data.receipt.rows_skipped, data.receipt.skipped_rows) == (1, [1])


def _with_template(tok: Any, template: str) -> Any:
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t
