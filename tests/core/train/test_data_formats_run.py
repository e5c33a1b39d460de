"""Each new data layout through the real trainer on the shared tiny model (two steps
each): the ``started`` event's receipt and its loss-token count against the count worked
out by hand (tiny template: a learned assistant turn is <|assistant|>, its tokens, </s>)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.utils import samples
from tests.utils.jobdirs import events, make_job, of_type


@pytest.fixture(scope="module")
def tok(tiny_causal_lm: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_causal_lm)


def n(tok: Any, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def started(
    root: Path, model: Path, rows: list[dict[str, Any]], run_main: Callable[[Path], int],
    dataset: dict[str, Any] | None = None, **training: Any,
) -> dict[str, Any]:
    spec = {
        "dataset": {"format": "auto", "max_seq_length": 1024, **(dataset or {})},
        "training": {"max_steps": 2, "per_device_train_batch_size": 2, "save_steps": 10,
                     "logging_steps": 1, **training},
    }
    job = make_job(root, model, rows, spec=spec)
    assert run_main(job) == 0
    (ev,) = of_type(events(job), "started")
    return ev


def test_openai_chat_weight_0_turns_train_nothing(
    tiny_causal_lm: Path, tok: Any, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    rows = [samples.OPENAI_WEIGHTED, samples.unweighted(samples.OPENAI_WEIGHTED)] * 2
    ev = started(tmp_path, tiny_causal_lm, rows, run_main)
    assert ev["data"]["layout"] == "openai_chat" and ev["data"]["detected"] is True
    first = 2 + n(tok, samples.OPENAI_WEIGHTED["messages"][2]["content"])
    last = 2 + n(tok, samples.OPENAI_WEIGHTED["messages"][4]["content"])
    assert ev["loss_tokens"] == 2 * last + 2 * (first + last)


def test_alpaca_trains_on_the_output_with_the_input_in_the_prompt(
    tiny_causal_lm: Path, tok: Any, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    ev = started(tmp_path, tiny_causal_lm, samples.ALPACA * 2, run_main)
    assert ev["data"]["columns_used"] == {"prompt": "instruction", "query": "input",
                                          "response": "output"}
    outputs = [2 + n(tok, r["output"]) for r in samples.ALPACA]
    assert ev["loss_tokens"] == 2 * sum(outputs)
    prompts = [n(tok, "Describe a process of making crepes."),
               n(tok, "Identify the odd one out.\nTwitter, Instagram, Telegram")]
    # <|user|> + the user text, then the learned turn.
    assert ev["tokens"] == 2 * sum(1 + p + o for p, o in zip(prompts, outputs))


def test_sharegpt_trains(
    tiny_causal_lm: Path, tok: Any, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    ev = started(tmp_path, tiny_causal_lm, [samples.SHAREGPT] * 4, run_main)
    assert ev["data"]["format"] == "sharegpt"
    assert ev["loss_tokens"] == 4 * (2 + n(tok, "An apple."))


def test_tool_calls_train_through_a_template_that_writes_them(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    """The tiny model's own template ignores tools: the job fails saying so, and trains
    with dataset.chat_template chatml."""
    from tests.utils.jobdirs import read_error

    job = make_job(tmp_path / "own", tiny_causal_lm, [samples.SHAREGPT_TOOLS] * 4,
                   spec={"dataset": {"format": "auto", "max_seq_length": 1024},
                         "training": {"max_steps": 1}})
    assert run_main(job) != 0
    assert read_error(job)["code"] == "invalid_dataset"
    assert "row 1: the chat template does not write the tools or tool calls" in read_error(job)["message"]
    ev = started(tmp_path / "chatml", tiny_causal_lm, [samples.SHAREGPT_TOOLS] * 4, run_main,
                 dataset={"chat_template": "chatml"})
    assert ev["data"]["layout"] == "sharegpt" and ev["loss_tokens"] > 0


@pytest.mark.parametrize(
    ("rows", "objective", "layout"),
    [
        ([samples.OPENAI_DPO] * 4, "dpo", "openai_dpo"),
        ([samples.SHAREGPT_DPO] * 4, "dpo", "sharegpt_preference"),
        ([samples.TRL_IMPLICIT] * 4, "dpo", "trl_implicit_preference"),
        ([samples.KTO_MESSAGES, {**samples.KTO_MESSAGES, "label": False}] * 2, "kto",
         "kto_messages"),
    ],
    ids=["openai_dpo", "sharegpt_dpo", "trl_implicit", "kto_messages"],
)
def test_preference_layouts_train(
    rows: list[dict[str, Any]], objective: str, layout: str, tiny_causal_lm: Path,
    tmp_path: Path, run_main: Callable[[Path], int],
) -> None:
    ev = started(tmp_path, tiny_causal_lm, rows, run_main, objective=objective)
    assert (ev["data"]["layout"], ev["examples"]) == (layout, 4)
