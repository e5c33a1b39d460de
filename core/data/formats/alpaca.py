"""alpaca (LLaMA-Factory's meaning): instruction, input, output, optional system and history.

The user turn is the instruction and the input joined by a newline (either may be empty),
as LLaMA-Factory's AlpacaDatasetConverter does; ``history`` is a list of earlier
[instruction, answer] pairs, which become user/assistant turns before it (their answers
are learned too, as LLaMA-Factory does by default); ``system`` a system message first.
"""

from __future__ import annotations

from typing import Any

from core.data.formats.base import Chat, Columns, Layout, Problems, as_json, is_text


def convert_alpaca(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Chat | None:
    msgs: list[dict[str, Any]] = []
    system = rec.get(cols["system"]) if "system" in cols else None
    if is_text(system):
        msgs.append({"role": "system", "content": system})
    history = as_json(rec.get(cols["history"])) if "history" in cols else None
    if history not in (None, "", []):
        if not isinstance(history, list):
            out.add(cols["history"], "must be a list of [instruction, answer] pairs")
            return None
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2 and all(is_text(x) for x in pair)):
                out.add(f"{cols['history']}[{i}]", "must be an [instruction, answer] pair of texts")
                return None
            msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    parts = []
    for role in ("prompt", "query"):
        v = rec.get(cols[role]) if role in cols else None
        if v is not None and not isinstance(v, str):
            out.add(cols[role], f"must be text, got {type(v).__name__}")
            return None
        if v:
            parts.append(v)
    if not any(p.strip() for p in parts):
        out.add(cols["prompt"], "empty: the instruction and the input are both empty")
        return None
    response = rec.get(cols["response"])
    if not is_text(response):
        out.add(cols["response"], "missing" if response is None else "must be non-empty text")
        return None
    msgs += [{"role": "user", "content": "\n".join(parts)}, {"role": "assistant", "content": response}]
    return Chat(msgs, [int(m["role"] == "assistant") for m in msgs])


LAYOUTS = [
    Layout(
        name="alpaca",
        format="alpaca",
        required=("prompt", "response"),
        optional=("query", "system", "history"),
        defaults={"prompt": "instruction", "query": "input", "response": "output",
                  "system": "system", "history": "history"},
        convert=convert_alpaca,
        doc="alpaca: instruction + input (joined by a newline) -> output; system, history",
    )
]
