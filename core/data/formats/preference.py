"""Preference pairs and KTO rows as users have them, converted to TRL's columns.

Pairs (dataset.format preference): TRL's explicit prompt/chosen/rejected (text, or message
lists), TRL's implicit prompt (chosen/rejected whole conversations sharing their start),
OpenAI's DPO rows (``input.messages``, ``preferred_output``, ``non_preferred_output``).
ShareGPT pairs live in sharegpt.py. KTO (dataset.format kto): prompt/completion/label, or
messages + label where the last (assistant) message is the completion.
Output: {"prompt", "chosen", "rejected"} or {"prompt", "completion", "label"}, text or
messages, which TRL's trainers render with the chat template and tokenize.
"""

from __future__ import annotations

from typing import Any

from core.data.formats.base import Columns, Layout, Problems, as_json
from core.data.formats.openai_chat import messages as openai_messages
from core.data.formats.openai_chat import tools as read_tools


def kto_label(v: Any) -> bool | None:
    """A kto row's label: a JSON boolean, or true/false as text (CSV cells); else None."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return None


def _turns_or_text(v: Any, column: str, prompt: Any, out: Problems) -> Any:
    """Non-empty text, or a non-empty list of {role, content} messages. For an answer,
    ``prompt`` is the row's prompt: after messages an answer may be text (one assistant
    turn) or messages; after a text prompt it must be text."""
    v = as_json(v)
    if v is None or v == "" or v == []:
        out.add(column, "missing" if v is None else "empty")
        return None
    if isinstance(v, str):
        if not v.strip():
            out.add(column, "empty text")
            return None
        if isinstance(prompt, list):
            return [{"role": "assistant", "content": v}]
        return v
    if not isinstance(v, list):
        out.add(column, f"must be text or a list of messages, got {type(v).__name__}")
        return None
    if isinstance(prompt, str):
        out.add(column, "must be text: the prompt is text, not messages")
        return None
    got = openai_messages(v, column, out, weights=False)
    return got[0] if got is not None else None


def _differ(chosen: Any, rejected: Any, cols: Columns, out: Problems) -> bool:
    if chosen is not None and chosen == rejected:
        out.add(cols["rejected"], f"identical to {cols['chosen']!r}: a pair must prefer one "
                "answer over a different one")
        return False
    return True


def convert_pair(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    prompt = _turns_or_text(rec.get(cols["prompt"]), cols["prompt"], None, out)
    chosen = _turns_or_text(rec.get(cols["chosen"]), cols["chosen"], prompt, out)
    rejected = _turns_or_text(rec.get(cols["rejected"]), cols["rejected"], prompt, out)
    if out or not _differ(chosen, rejected, cols, out):
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _split_common(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen rest, rejected rest): the shared start is the prompt (TRL's implicit
    prompt). Messages split at whole messages; text at the last space of the shared start."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str):
        n = chosen.rfind(" ", 0, n + 1) + 1 if n < len(chosen) else n
    return chosen[:n], chosen[n:], rejected[n:]


def convert_implicit_pair(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    chosen = _turns_or_text(rec.get(cols["chosen"]), cols["chosen"], None, out)
    rejected = _turns_or_text(rec.get(cols["rejected"]), cols["rejected"], chosen, out)
    if out or not _differ(chosen, rejected, cols, out):
        return None
    prompt, c, r = _split_common(chosen, rejected)
    if not prompt:
        out.add(cols["chosen"], f"shares no start with {cols['rejected']!r}: without a prompt "
                "column the prompt is what the two have in common")
        return None
    if not c or not r:
        out.add(cols["rejected"], "one of the answers is empty after the prompt both share")
        return None
    if isinstance(c, list) and any(m["role"] != "assistant" for m in c + r):
        out.add(cols["chosen"], "after the shared prompt only assistant messages may differ")
        return None
    return {"prompt": prompt, "chosen": c, "rejected": r}


def convert_openai_dpo(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    inp = as_json(rec.get(cols["input"]))
    if not isinstance(inp, dict) or "messages" not in inp:
        out.add(cols["input"], 'must be {"messages": [...]} (OpenAI DPO)')
        return None
    got = openai_messages(inp["messages"], f"{cols['input']}.messages", out, weights=False)
    tl = read_tools(inp, {"tools": "tools", "functions": "functions"}, out)
    answers = []
    for role in ("chosen", "rejected"):
        a = openai_messages(rec.get(cols[role]), cols[role], out, weights=False)
        if a is not None and any(m["role"] != "assistant" for m in a[0]):
            out.add(cols[role], "must hold assistant messages only")
        answers.append(a[0] if a else None)
    if got is None or out or not _differ(answers[0], answers[1], cols, out):
        return None
    row: dict[str, Any] = {"prompt": got[0], "chosen": answers[0], "rejected": answers[1]}
    if tl:
        row["tools"] = tl
    return row


def convert_kto(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    prompt = _turns_or_text(rec.get(cols["prompt"]), cols["prompt"], None, out)
    completion = _turns_or_text(rec.get(cols["completion"]), cols["completion"], prompt, out)
    label = _label(rec, cols, out)
    if out:
        return None
    return {"prompt": prompt, "completion": completion, "label": label}


def convert_kto_messages(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    got = openai_messages(rec.get(cols["messages"]), cols["messages"], out, weights=False)
    label = _label(rec, cols, out)
    if got is None or out:
        return None
    msgs = got[0]
    if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
        out.add(cols["messages"], "the last message must be the assistant's (the completion), "
                "after at least one prompt message")
        return None
    return {"prompt": msgs[:-1], "completion": msgs[-1:], "label": label}


def _label(rec: dict[str, Any], cols: Columns, out: Problems) -> bool | None:
    v = rec.get(cols["kto_tag"])
    label = kto_label(v)
    if label is None:
        out.add(cols["kto_tag"], "missing" if v in (None, "") else f"must be true or false, got {v!r}")
    return label


def _answers_are_text_or_messages(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    return isinstance(as_json(rec.get(cols["chosen"])), (str, list))


def _openai_input(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    v = as_json(rec.get(cols["input"]))
    return isinstance(v, dict) and "messages" in v


def _role_messages(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    v = as_json(rec.get(cols["messages"]))
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict) and "role" in v[0]


LAYOUTS = [
    Layout(
        name="trl_preference",
        format="preference",
        required=("prompt", "chosen", "rejected"),
        optional=(),
        defaults={"prompt": "prompt", "chosen": "chosen", "rejected": "rejected"},
        convert=convert_pair,
        looks_right=_answers_are_text_or_messages,
        doc="TRL: prompt/chosen/rejected, text or message lists",
    ),
    Layout(
        name="trl_implicit_preference",
        format="preference",
        required=("chosen", "rejected"),
        optional=(),
        defaults={"chosen": "chosen", "rejected": "rejected"},
        convert=convert_implicit_pair,
        looks_right=_answers_are_text_or_messages,
        doc="TRL implicit prompt: chosen/rejected whole conversations sharing their start",
    ),
    Layout(
        name="openai_dpo",
        format="preference",
        required=("input", "chosen", "rejected"),
        optional=(),
        defaults={"input": "input", "chosen": "preferred_output",
                  "rejected": "non_preferred_output"},
        convert=convert_openai_dpo,
        looks_right=_openai_input,
        doc="OpenAI DPO: input.messages, preferred_output, non_preferred_output",
    ),
    Layout(
        name="kto",
        format="kto",
        required=("prompt", "completion", "kto_tag"),
        optional=(),
        defaults={"prompt": "prompt", "completion": "completion", "kto_tag": "label"},
        convert=convert_kto,
        doc="TRL KTO: prompt/completion/label (true: desirable)",
    ),
    Layout(
        name="kto_messages",
        format="kto",
        required=("messages", "kto_tag"),
        optional=(),
        defaults={"messages": "messages", "kto_tag": "label"},
        convert=convert_kto_messages,
        looks_right=_role_messages,
        doc="KTO messages + boolean label: the last assistant message is the completion",
    ),
]
