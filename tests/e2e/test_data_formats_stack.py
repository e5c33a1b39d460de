"""Data as users already have it, all the way: each layout uploaded over HTTP, submitted
with format auto, trained for real by a Celery worker (`accelerate launch`, the tiny Llama),
and what it read and trained on said back.

One embedded stack (SQLite + filesystem broker) and one tiny model serve every case; every
job is submitted up front so the worker trains them back to back while the cases are
checked. Each file is read for exactly one epoch (4 rows, 2 per step, 2 steps), so the loss
tokens the trainer counted over its micro-batches (``loss_tokens_trained``) are every loss
token of the file, and are compared with a count worked out by hand from the templates:

* the tiny model's template (with {% generation %} markers) learns ``<|assistant|>``, the
  answer's tokens and ``</s>``: 2 + n(answer) per learned turn;
* chatml (named with dataset.chat_template: the tiny template ignores tools; no markers,
  so ftune finds the spans by rendering prefixes) learns the answer, its tool calls and
  ``<|im_end|>\\n``, and ftune adds the ``</s>`` the turn lacks: n(turn text) + 1;
* TRL's preference trainers learn the completion after the rendered prompt: the answer
  and ``</s>``: n(answer) + 1 per answer (chosen and rejected both).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cli.embedded import EmbeddedStack
from client import FtuneClient
from tests.utils import samples
from tests.utils.tiny import write_jsonl

pytestmark = pytest.mark.e2e

IM_END = "<|im_end|>\n"
Count = Callable[[str], int]  # tokens of a text, no special tokens added


def tool_call(function: dict[str, Any]) -> str:
    # chatml writes each call's function with tojson (transformers': json.dumps, keys in order).
    return "<tool_call>\n" + json.dumps(function) + "\n</tool_call>"


# OpenAI's and LLaMA-Factory's tool samples (tests/utils/samples.py) in words the tiny
# tokenizer knows: theirs, with tools listed in the system turn, take more than the tiny
# model's 512 positions (nearly every character outside its vocabulary is a token) and
# would be cut, which the counts below do not model.
SEE_TOOL = {"name": "see", "description": "sees a star",
            "parameters": {"type": "object", "properties": {"what": {"type": "string"}}}}
OPENAI_TOOLS = {
    "messages": [
        {"role": "user", "content": "the dog sees a star"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "see", "arguments": '{"what": "star"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a big star"},
        {"role": "assistant", "content": "the dog sees a big star"},
    ],
    "tools": [{"type": "function", "function": SEE_TOOL}],
    "parallel_tool_calls": False,
}
SHAREGPT_TOOLS = {
    "conversations": [
        {"from": "human", "value": "the cat sees a moon"},
        {"from": "function_call", "value": json.dumps({"name": "see", "arguments": {"what": "moon"}})},
        {"from": "observation", "value": "a small moon"},
        {"from": "gpt", "value": "the cat sees a small moon"},
    ],
    "tools": json.dumps([SEE_TOOL]),
}


def openai_chat_loss(n: Count) -> int:
    weighted, tools = samples.OPENAI_WEIGHTED["messages"], OPENAI_TOOLS["messages"]
    call = tools[1]["tool_calls"][0]["function"]
    function = {"name": call["name"], "arguments": json.loads(call["arguments"])}
    per_pair = (
        # The weight-0 "Paris" turn carries none; the weighted answer does.
        n(weighted[4]["content"] + IM_END) + 1
        # The tool call (no text), then the answer after the tool's result.
        + n(tool_call(function) + IM_END) + 1
        + n(tools[3]["content"] + IM_END) + 1
    )
    return 2 * per_pair


def alpaca_loss(n: Count) -> int:
    return 2 * sum(2 + n(r["output"]) for r in samples.ALPACA)


def alpaca_tokens(n: Count) -> int:
    # <|user|> + the instruction, with the input (where there is one) after a newline.
    prompts = [n(r["instruction"] + ("\n" + r["input"] if r["input"] else ""))
               for r in samples.ALPACA]
    return 2 * sum(1 + p + 2 + n(r["output"]) for p, r in zip(prompts, samples.ALPACA))


def sharegpt_loss(n: Count) -> int:
    turns = SHAREGPT_TOOLS["conversations"]
    call = json.loads(turns[1]["value"])
    with_tools = (n(tool_call(call) + IM_END) + 1) + (n(turns[3]["value"] + IM_END) + 1)
    plain = n(samples.SHAREGPT["conversations"][2]["value"] + IM_END) + 1
    return 2 * (with_tools + plain)


def pair_loss(chosen: str, rejected: str) -> Callable[[Count], int]:
    return lambda n: 4 * ((n(chosen) + 1) + (n(rejected) + 1))


@dataclass
class Case:
    id: str
    rows: list[dict[str, Any]]
    receipt: dict[str, Any]
    loss_tokens: Callable[[Count], int]
    training: dict[str, Any] = field(default_factory=dict)
    dataset: dict[str, Any] = field(default_factory=dict)
    tokens: Callable[[Count], int] | None = None  # input tokens, where the case shows them


CHATML = {"chat_template": "chatml"}
DPO = {"objective": "dpo"}
OPENAI_DPO_ANSWERS = (samples.OPENAI_DPO["preferred_output"][0]["content"],
                      samples.OPENAI_DPO["non_preferred_output"][0]["content"])

CASES = [
    Case("openai_chat_weight_0_and_tools", [samples.OPENAI_WEIGHTED, OPENAI_TOOLS] * 2,
         {"format": "chat", "layout": "openai_chat",
          "columns_used": {"messages": "messages", "tools": "tools"},
          "columns_ignored": ["parallel_tool_calls"]},
         openai_chat_loss, dataset=CHATML),
    Case("alpaca_with_and_without_input", samples.ALPACA * 2,
         {"format": "alpaca", "layout": "alpaca",
          "columns_used": {"prompt": "instruction", "query": "input", "response": "output"},
          "columns_ignored": []},
         alpaca_loss, tokens=alpaca_tokens),
    Case("sharegpt_system_function_call_observation",
         [SHAREGPT_TOOLS, samples.SHAREGPT] * 2,
         {"format": "sharegpt", "layout": "sharegpt",
          "columns_used": {"messages": "conversations", "tools": "tools"},
          "columns_ignored": []},
         sharegpt_loss, dataset=CHATML),
    Case("trl_explicit_prompt", [samples.TRL_PAIR] * 4,
         {"format": "preference", "layout": "trl_preference",
          "columns_used": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
          "columns_ignored": []},
         pair_loss("It is blue.", "It is green."), training=DPO),
    Case("trl_implicit_prompt", [samples.TRL_IMPLICIT] * 4,
         {"format": "preference", "layout": "trl_implicit_preference",
          "columns_used": {"chosen": "chosen", "rejected": "rejected"},
          "columns_ignored": []},
         pair_loss("It is blue.", "It is green."), training=DPO),
    Case("openai_dpo", [samples.OPENAI_DPO] * 4,
         {"format": "preference", "layout": "openai_dpo",
          "columns_used": {"input": "input", "chosen": "preferred_output",
                           "rejected": "non_preferred_output"},
          "columns_ignored": []},
         pair_loss(*OPENAI_DPO_ANSWERS), training=DPO),
    Case("llama_factory_sharegpt_preference", [samples.SHAREGPT_DPO] * 4,
         {"format": "preference", "layout": "sharegpt_preference",
          "columns_used": {"messages": "conversations", "chosen": "chosen",
                           "rejected": "rejected"},
          "columns_ignored": []},
         pair_loss(samples.SHAREGPT_DPO["chosen"]["value"],
                   samples.SHAREGPT_DPO["rejected"]["value"]), training=DPO),
    Case("kto_messages", [samples.KTO_MESSAGES, {**samples.KTO_MESSAGES, "label": False}] * 2,
         {"format": "kto", "layout": "kto_messages",
          "columns_used": {"messages": "messages", "kto_tag": "label"},
          "columns_ignored": []},
         lambda n: 4 * (n(samples.KTO_MESSAGES["messages"][1]["content"]) + 1),
         training={"objective": "kto"}),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[EmbeddedStack]:
    root = tmp_path_factory.mktemp("formats-stack")
    stack = EmbeddedStack(
        data_dir=root,
        api_key="ft_test_" + secrets.token_hex(16),
        env_overrides={
            "DATABASE_URL": f"sqlite:///{root / 'ftune.db'}",
            "BROKER_URL": "filesystem://",
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_JOBS_PER_MINUTE_PER_TENANT": "1000",
            # Two jobs at a time, each on its own core: a tiny run is mostly imports (one
            # thread), so two slots halve the wall time on a 2-core machine.
            "FTUNE_WORKER_SLOTS": "2",
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def submitted(
    client: FtuneClient, tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, Any], str]]:
    """case id -> (the upload's file object, the job's id), every job queued at once."""
    tmp = tmp_path_factory.mktemp("formats-data")
    out = {}
    for case in CASES:
        f = client.upload_file(write_jsonl(tmp / f"{case.id}.jsonl", case.rows))
        spec = {
            "model": {"name_or_path": str(tiny_causal_lm)},
            # No format: auto, the default.
            "dataset": {"file_id": f["id"], "max_seq_length": 512, **case.dataset},
            "peft": {"method": "lora", "r": 4, "lora_alpha": 8},
            "training": {"max_steps": 2, "per_device_train_batch_size": 2, "logging_steps": 1,
                         "save_steps": 100, **case.training},
        }
        out[case.id] = (f, client.create_job(spec)["id"])
    return out


@pytest.fixture(scope="module")
def n(tiny_causal_lm: Path) -> Count:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_layout_trains_with_the_loss_tokens_worked_out_by_hand(
    case: Case, client: FtuneClient, submitted: dict[str, tuple[dict[str, Any], str]], n: Count
) -> None:
    upload, job_id = submitted[case.id]
    # The upload said what it holds before any job was asked for.
    assert (upload["detected"]["layout"], upload["detected"]["columns_ignored"]) == (
        case.receipt["layout"], case.receipt["columns_ignored"])
    job = client.wait(job_id, timeout=600)
    assert job["status"] == "succeeded", job.get("error")
    receipt = {**case.receipt, "detected": True, "rows": 4}
    assert job["data"] == receipt
    events = client.events(job_id)
    (started,) = [e["data"] for e in events if e["type"] == "started"]
    assert started["data"] == receipt
    assert started["truncated"] == 0  # the counts below are of whole rows
    last = [e["data"] for e in events if e["type"] == "progress"][-1]
    assert (last["step"], last["epoch"]) == (2, 1.0)
    assert last["loss_tokens_trained"] == case.loss_tokens(n)
    if case.training.get("objective") is None:
        # Supervised: the data as tokenized holds exactly what the loss then saw.
        assert started["loss_tokens"] == last["loss_tokens_trained"]
    if case.tokens is not None:
        assert started["tokens"] == case.tokens(n)
