"""The row checks of training.objective grpo, at upload/submit and again in the trainer.

A GRPO row is a prompt plus any extra fields: ``dataset.messages_field`` holds the chat
messages (OpenAI's reinforcement rows: {"messages": [...], "reference_answer": ...}), the
last one from the user (the model answers it); every other field is the grader's ``item``.
Each field a grader template references ({{item.answer}}) must be present, and not null,
in every row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.data.files import DataProblem
from core.data.formats import as_json as as_turns
from core.spec import DatasetSpec
from core.spec.graders import Grader, item_fields

ROLES = ("system", "developer", "user", "assistant")


def grpo_row_check(
    ds: DatasetSpec, grader: Grader | None
) -> Callable[[dict[str, Any]], list[DataProblem]]:
    """The check of one row (problems without the row number; the caller adds it)."""
    fields = sorted(item_fields(grader)) if grader is not None else []

    def check(rec: dict[str, Any]) -> list[DataProblem]:
        out = prompt_problems(rec, ds.messages_field)
        for name in fields:
            if rec.get(name) is None:
                out.append(DataProblem(
                    None, name, f"missing: the grader references {{{{item.{name}}}}}"
                ))
        return out

    return check


def prompt_problems(rec: dict[str, Any], field: str) -> list[DataProblem]:
    msgs = as_turns(rec.get(field))
    if msgs is None:
        return [DataProblem(None, field, "missing")]
    if not isinstance(msgs, list) or not msgs:
        return [DataProblem(None, field, "must be a non-empty list of messages")]
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return [DataProblem(None, f"{field}[{i}]", f"needs a role ({', '.join(ROLES)}) "
                                "and content")]
        if not isinstance(m.get("content"), str):
            return [DataProblem(None, f"{field}[{i}].content", "must be text")]
    if msgs[-1]["role"] != "user":
        return [DataProblem(None, field, f"the last message is from {msgs[-1]['role']}: a "
                            "GRPO prompt ends with the user's message, which the model answers")]
    if not msgs[-1]["content"].strip():
        return [DataProblem(None, f"{field}[{len(msgs) - 1}].content", "empty text")]
    return []


def item_of(rec: dict[str, Any], messages_field: str) -> dict[str, Any]:
    """The grader's ``item``: the row as uploaded (its messages included, as OpenAI does)."""
    return {k: as_turns(v) if k == messages_field else v for k, v in rec.items()}
