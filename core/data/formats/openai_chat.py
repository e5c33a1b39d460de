"""OpenAI's chat fine-tuning lines: ``{"messages": [...], "tools": [...]}``.

Everything OpenAI's format allows for text models is read: per-message ``weight`` (0 or 1,
assistant turns; 0 keeps the turn as context without loss), ``tools`` (or the older
``functions``), assistant ``tool_calls`` (or the older ``function_call``), ``tool`` (and
``function``) messages, ``name``, and content given as a list of text parts (joined). Image
and audio parts are refused: ftune trains text models. ``developer`` messages are system
messages to a chat template.
"""

from __future__ import annotations

from typing import Any

from core.data.formats.base import Chat, Columns, Layout, Problems, as_json

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
_MEDIA = {"image_url", "input_image", "image", "input_audio", "audio", "file", "input_file"}


def content_text(v: Any, where: str, out: Problems) -> str | None:
    """A message's content as text: a string, null (an assistant turn that only calls
    tools), or a list of parts whose text parts are joined."""
    if v is None or isinstance(v, str):
        return v or ""
    if not isinstance(v, list):
        out.add(where, f"must be text or a list of content parts, got {type(v).__name__}")
        return None
    texts = []
    for i, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA:
            out.add(
                f"{where}[{i}]",
                f"a {kind} part: images, audio and files are not supported (ftune trains "
                "text models); remove the part or the row",
            )
            return None
        if kind != "text" or not isinstance(part.get("text"), str):
            out.add(f"{where}[{i}]", 'a content part must be {"type": "text", "text": "..."}')
            return None
        texts.append(part["text"])
    # OpenAI reads consecutive text parts as one text.
    return "".join(texts)


def _tool_calls(v: Any, where: str, out: Problems) -> list[dict[str, Any]] | None:
    """Tool calls as chat templates take them: arguments as an object (OpenAI stores them
    as JSON text; templates such as Qwen's and Llama's write them with tojson)."""
    if not isinstance(v, list) or not v:
        out.add(where, "must be a non-empty list of tool calls")
        return None
    calls = []
    for i, call in enumerate(v):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            out.add(f"{where}[{i}]", 'needs {"type": "function", "function": {"name", "arguments"}}')
            return None
        args = as_json(fn.get("arguments", {}))
        new = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            new["id"] = call["id"]
        calls.append(new)
    return calls


def messages(
    raw: Any, column: str, out: Problems, *, weights: bool = True
) -> tuple[list[dict[str, Any]], list[int]] | None:
    """OpenAI messages -> (template messages, per-message weights), or None (problems
    added). Weights: 1 for assistant turns unless ``weight`` is 0, 0 for the others."""
    raw = as_json(raw)
    if not isinstance(raw, list) or not raw:
        out.add(column, "must be a non-empty list of messages")
        return None
    msgs: list[dict[str, Any]] = []
    ws: list[int] = []
    for i, m in enumerate(raw):
        where = f"{column}[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str):
            out.add(where, "needs role and content")
            return None
        if role not in ROLES:
            out.add(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}")
            return None
        text = content_text(m.get("content"), f"{where}.content", out)
        if text is None:
            return None
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if role == "function":  # the older function-calling API: a tool's answer
            msg["role"] = "tool"
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is None and isinstance(m.get("function_call"), dict):
                calls = [{"type": "function", "function": m["function_call"]}]
            if calls is not None:
                msg["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls", out)
                if msg["tool_calls"] is None:
                    return None
            elif not text.strip():
                out.add(f"{where}.content", "must be non-empty text")
                return None
        elif not text.strip() and role != "tool":
            out.add(f"{where}.content", "must be non-empty text")
            return None
        w = 1 if role == "assistant" else 0
        if "weight" in m:
            if role != "assistant":
                out.add(f"{where}.weight", "only assistant messages carry a weight")
                return None
            if m["weight"] not in (0, 1) or isinstance(m["weight"], bool):
                out.add(f"{where}.weight", f"must be 0 or 1, got {m['weight']!r}")
                return None
            w = int(m["weight"]) if weights else 1
        msgs.append(msg)
        ws.append(w)
    return msgs, ws


def tools(rec: dict[str, Any], cols: Columns, out: Problems) -> list[dict[str, Any]] | None:
    """The row's tools as chat templates take them ({"type": "function", "function": ...}):
    OpenAI's ``tools``, or the older ``functions`` (plain function definitions)."""
    for role in ("tools", "functions"):
        col = cols.get(role)
        v = as_json(rec.get(col)) if col else None
        if v is None or v == "" or v == []:
            continue
        if isinstance(v, dict):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
            out.add(col, "must be a list of tool definitions")
            return None
        fixed = []
        for i, t in enumerate(v):
            fn = t.get("function") if t.get("type") == "function" else t
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                out.add(f"{col}[{i}]", "a tool needs a function with a name")
                return None
            fixed.append({"type": "function", "function": fn})
        return fixed
    return None


def convert_chat(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Chat | None:
    got = messages(rec.get(cols["messages"]), cols["messages"], out)
    tl = tools(rec, cols, out)
    if got is None or out:
        return None
    msgs, ws = got
    if not any(ws):
        has_assistant = any(m["role"] == "assistant" for m in msgs)
        out.add(
            cols["messages"],
            "every assistant turn has weight 0: nothing to learn"
            if has_assistant
            else "no assistant turn to learn",
        )
        return None
    return Chat(msgs, ws, tl)


def looks_like_openai(rec: dict[str, Any], cols: Columns, ctx: Any) -> bool:
    v = as_json(rec.get(cols["messages"]))
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict) and "role" in v[0]


LAYOUTS = [
    Layout(
        name="openai_chat",
        format="chat",
        required=("messages",),
        optional=("tools", "functions"),
        defaults={"messages": "messages", "tools": "tools", "functions": "functions"},
        convert=convert_chat,
        looks_right=looks_like_openai,
        doc="OpenAI chat: messages of {role, content, weight, tool_calls, name}, tools",
    )
]
