"""The plain column formats: text, prompt_completion, seq2seq, classification.

Converted to canonical keys (text / prompt, completion / input, target / text, label) so
the trainer reads one layout whatever the file calls its columns."""

from __future__ import annotations

from typing import Any

from core.data.formats.base import Columns, Layout, Problems, need_text


def _texts(*roles: str) -> Any:
    def convert(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
        got = {r: need_text(rec, cols[r], out) for r in roles}
        return None if out else got

    return convert


def convert_classification(rec: dict[str, Any], cols: Columns, ctx: Any, out: Problems) -> Any:
    text = need_text(rec, cols["text"], out)
    lab = rec.get(cols["label"])
    if lab is None or lab == "":
        out.add(cols["label"], "missing")
    elif isinstance(lab, bool) or not isinstance(lab, (str, int)):
        out.add(cols["label"], "must be a string or an integer")
    return None if out else {"text": text, "label": str(lab)}


LAYOUTS = [
    Layout("text", "text", ("text",), (), {"text": "text"}, _texts("text"),
           doc="one column of raw text"),
    Layout("prompt_completion", "prompt_completion", ("prompt", "completion"), (),
           {"prompt": "prompt", "completion": "completion"}, _texts("prompt", "completion"),
           doc="prompt -> completion (loss on the completion)"),
    Layout("seq2seq", "seq2seq", ("input", "target"), (), {"input": "input", "target": "target"},
           _texts("input", "target"), doc="input -> target (encoder-decoder)"),
    Layout("classification", "classification", ("text", "label"), (),
           {"text": "text", "label": "label"}, convert_classification,
           doc="text -> label (class name or id)"),
]
