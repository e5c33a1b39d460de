"""ShareGPT (LLaMA-Factory's meaning): ``conversations`` of {from, value} turns.

Roles by tag (``dataset.tags``, LLaMA-Factory's names and defaults): human -> user, gpt ->
assistant, system -> system (first turn only), function_call -> an assistant tool call
(its value: {"name", "arguments"} as JSON, or a list of them), observation -> a tool
answer. A ``tools`` column (JSON text or a list of function definitions) is passed to the
chat template. The preference variant: conversations + ``chosen`` / ``rejected`` turns.
"""

from __future__ import annotations

from typing import Any

from core.data.formats.base import Chat, Columns, Layout, Problems, as_json, is_text
from core.data.formats.openai_chat import tools as read_tools
from core.spec import ShareGptTags


def _tags(ctx: Any) -> Any:
    return getattr(ctx, "tags", None) or ShareGptTags()


def _turn(m: Any, where: str, ctx: Any, out: Problems, first: bool) -> dict[str, Any] | None:
    t = _tags(ctx)
    if not isinstance(m, dict) or t.role_tag not in m:
        out.add(where, f"needs {t.role_tag!r} and {t.content_tag!r}")
        return None
    tag, value = m.get(t.role_tag), m.get(t.content_tag)
    if not is_text(value):
        out.add(f"{where}.{t.content_tag}", "must be non-empty text")
        return None
    if tag == t.user_tag:
        return {"role": "user", "content": value}
    if tag == t.assistant_tag:
        return {"role": "assistant", "content": value}
    if tag == t.observation_tag:
        return {"role": "tool", "content": value}
    if tag == t.system_tag and first:
        return {"role": "system", "content": value}
    if tag == t.function_tag:
        calls = as_json(value)
        calls = [calls] if isinstance(calls, dict) else calls
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            out.add(f"{where}.{t.content_tag}", 'a function call must be JSON {"name", "arguments"}')
            return None
        return {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function",
                 "function": {"name": c["name"], "arguments": as_json(c.get("arguments", {}))}}
                for c in calls
            ],
        }
    known = [t.user_tag, t.assistant_tag, t.observation_tag, t.function_tag, t.system_tag]
    what = f"{tag!r} is not one of {', '.join(map(repr, known))}"
    if tag == t.system_tag:
        what = "a system turn must come first"
    out.add(f"{where}.{t.role_tag}", what)
    return None


def turns(raw: Any, column: str, ctx: Any, out: Problems) -> list[dict[str, Any]] | None:
    raw = as_json(raw)
    if not isinstance(raw, list) or not raw:
        out.add(column, "must be a non-empty list of turns")
        return None
    msgs = []
    for i, m in enumerate(raw):
        turn = _turn(m, f"{column}[{i}]", ctx, out, first=i == 0)
        if turn is None:
            return None
        msgs.append(turn)
    return msgs


def _system_first(rec: dict[str, Any], cols: Columns, msgs: list[dict[str, Any]]) -> None:
    system = rec.get(cols["system"]) if "system" in cols else None
    if is_text(system) and (not msgs or msgs[0]["role"] != "system"):
        msgs.insert(0, {"role": "system", "content": system})


def convert_sharegpt(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Chat | None:
    msgs = turns(rec.get(cols["messages"]), cols["messages"], ctx, out)
    tl = read_tools(rec, cols, out)
    if msgs is None or out:
        return None
    if msgs[-1]["role"] != "assistant":
        out.add(cols["messages"], "the last turn must be the model's (gpt or function_call)")
        return None
    _system_first(rec, cols, msgs)
    return Chat(msgs, [int(m["role"] == "assistant") for m in msgs], tl)


def convert_sharegpt_preference(
    rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems
) -> dict[str, Any] | None:
    msgs = turns(rec.get(cols["messages"]), cols["messages"], ctx, out)
    answers = []
    for role in ("chosen", "rejected"):
        turn = _turn(as_json(rec.get(cols[role])), cols[role], ctx, out, first=False)
        if turn is not None and turn["role"] != "assistant":
            out.add(cols[role], "must be the model's turn (gpt or function_call)")
        answers.append(turn)
    if msgs is None or out:
        return None
    if msgs[-1]["role"] == "assistant":
        out.add(cols["messages"], "the last turn must be the user's: chosen/rejected answer it")
        return None
    if answers[0] == answers[1]:
        out.add(cols["rejected"], f"identical to {cols['chosen']!r}: a pair must prefer one "
                "answer over a different one")
        return None
    _system_first(rec, cols, msgs)
    return {"prompt": msgs, "chosen": [answers[0]], "rejected": [answers[1]]}


def _looks_like_sharegpt(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    v = as_json(rec.get(cols["messages"]))
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict) and _tags(ctx).role_tag in v[0]


def _pair_of_turns(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    return _looks_like_sharegpt(rec, cols, ctx) and isinstance(as_json(rec.get(cols["chosen"])), dict)


_DEFAULTS = {"messages": "conversations", "system": "system", "tools": "tools",
             "chosen": "chosen", "rejected": "rejected"}

LAYOUTS = [
    Layout(
        name="sharegpt",
        format="sharegpt",
        required=("messages",),
        optional=("system", "tools"),
        defaults=_DEFAULTS,
        convert=convert_sharegpt,
        looks_right=_looks_like_sharegpt,
        doc="ShareGPT: conversations of {from, value} (human, gpt, system, function_call, "
        "observation), tools",
    ),
    Layout(
        name="sharegpt_preference",
        format="preference",
        required=("messages", "chosen", "rejected"),
        optional=("system",),
        defaults=_DEFAULTS,
        convert=convert_sharegpt_preference,
        looks_right=_pair_of_turns,
        doc="LLaMA-Factory ShareGPT preference: conversations + chosen/rejected turns",
    ),
]
