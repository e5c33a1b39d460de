"""What every data converter shares: the internal layouts, the converter record, problems.

A *layout* is one way users already store a kind of example (OpenAI chat lines, alpaca
instruction/input/output, ShareGPT conversations, OpenAI's DPO rows, ...). Each has a small
converter from its row to one internal layout:

* ``Chat``: messages for the chat template (+ per-message weights and tools): what
  supervised chat training renders;
* a TRL row for preference (prompt / chosen / rejected) and KTO (prompt / completion /
  label), which TRL's trainers tokenize themselves;
* a dict with canonical keys for the plain formats (text, prompt/completion, input/target,
  text/label).

A converter reads columns by *role* (LLaMA-Factory's ``columns`` keys: prompt, query,
response, messages, ...); which file column plays each role comes from the spec (see
``columns_for``), so a renamed column needs no code. Pure: no torch, no web code.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class DataProblem:
    row: int | None
    field: str | None
    message: str
    # The spec parameter a fix goes to (dataset.columns.prompt, dataset.format, ...).
    param: str | None = None

    def __str__(self) -> str:
        where = []
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


@dataclass
class Chat:
    """A conversation as the chat template takes it.

    ``messages`` hold role, content (text) and, where given, tool_calls / name /
    tool_call_id; ``weights`` has one entry per message: 1 where an assistant turn carries
    loss, 0 elsewhere (OpenAI's per-message ``weight``: 0 keeps a turn as context only)."""

    messages: list[dict[str, Any]]
    weights: list[int]
    tools: list[dict[str, Any]] | None = None


class Problems:
    """The problems of one row, as a converter finds them (field names are file columns)."""

    def __init__(self) -> None:
        self.items: list[DataProblem] = []

    def add(self, column: str | None, message: str) -> None:
        self.items.append(DataProblem(None, column, message))

    def __bool__(self) -> bool:
        return bool(self.items)


Columns = dict[str, str]  # role -> file column
Converter = Callable[[dict[str, Any], Columns, Any, Problems], Any]


@dataclass(frozen=True)
class Layout:
    """One way of storing examples, and its converter to the internal layout.

    ``required`` / ``optional`` are roles; ``defaults`` their usual column names.
    ``looks_right`` tells, from a sample row, whether the columns hold this layout's shapes
    (ShareGPT's {from, value} vs OpenAI's {role, content}); detection uses it."""

    name: str
    format: str  # the dataset.format it belongs to
    required: tuple[str, ...]
    optional: tuple[str, ...]
    defaults: dict[str, str]
    convert: Converter
    looks_right: Callable[[dict[str, Any], Columns, Any], bool] = lambda rec, cols, ctx: True
    doc: str = ""

    def roles(self) -> tuple[str, ...]:
        return self.required + self.optional


@dataclass
class Receipt:
    """What was read from the data and how: said back in the dry run, the job object and
    the trainer's ``started`` event."""

    format: str
    layout: str
    detected: bool  # true when dataset.format was "auto"
    columns_used: dict[str, str]  # role -> column
    columns_ignored: list[str]
    rows: int = 0
    rows_skipped: int = 0  # rows without loss tokens, skipped because the spec allows it
    skipped_rows: list[int] = field(default_factory=list)  # the first few (1-based)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.format,
            "layout": self.layout,
            "detected": self.detected,
            "columns_used": self.columns_used,
            "columns_ignored": self.columns_ignored,
            "rows": self.rows,
        }
        if self.rows_skipped:
            out["rows_skipped"] = self.rows_skipped
            out["skipped_rows"] = self.skipped_rows
        return out


# ---------------------------------------------------------------------------- helpers


def is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def as_json(v: Any) -> Any:
    """A value as stored: CSV cells (and some tools' files) hold lists and objects as JSON
    text; anything else is returned as it is."""
    if isinstance(v, str) and v.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def did_you_mean(name: str, candidates: list[str]) -> str:
    """ " (did you mean 'x'?)" for the closest candidate, or ""."""
    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    if not close:
        # Case and separators differ more than difflib's ratio forgives ("Prompt", "prompt_").
        norm = {c.lower().strip("_- "): c for c in candidates}
        hit = norm.get(name.lower().strip("_- "))
        close = [hit] if hit else []
    return f" (did you mean {close[0]!r}?)" if close else ""


def need_text(rec: dict[str, Any], column: str, out: Problems) -> str | None:
    v = rec.get(column)
    if v is None:
        out.add(column, "missing")
    elif not isinstance(v, str):
        out.add(column, f"must be text, got {type(v).__name__}")
    elif not v.strip():
        out.add(column, "empty text")
    else:
        return v
    return None
