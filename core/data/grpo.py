"""training.objective grpo's data: the row checks, at upload/submit and again in the
trainer, and the datasets of prompts the trainer (core/train/grpo.py) and the estimate read.

A GRPO row is a prompt plus any extra fields: ``dataset.messages_field`` holds the chat
messages (OpenAI's reinforcement rows: {"messages": [...], "reference_answer": ...}), the
last one from the user (the model answers it); every other field is the grader's ``item``.
Each field a grader template references ({{item.answer}}) must be present, and not null,
in every row."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.data.datasets import Datasets, read_checked_rows, split_for_eval
from core.data.files import DataProblem
from core.data.formats import as_json as as_turns
from core.data.tokenize import DataStats, TokenizedDataset
from core.spec import DatasetSpec, JobSpec
from core.spec.graders import Grader, item_fields

ROLES = ("system", "developer", "user", "assistant")
ITEM_COLUMN = "ftune_item"  # the row as JSON text (Arrow wants one type per column)
ROW_COLUMN = "ftune_row"  # the row's number in its file, for error reports


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


def build_grpo_datasets(
    spec: JobSpec, train_path: Path, eval_path: Path | None, max_decompressed_bytes: int | None
) -> Datasets:
    """Prompts (the messages) + the row as the grader's item, checked as at submit."""
    ds = spec.dataset
    assert spec.training.grpo is not None
    check = grpo_row_check(ds, spec.training.grpo.grader)
    rows, _ = read_checked_rows(train_path, ds, "training", max_decompressed_bytes, check)
    numbers = list(range(1, len(rows) + 1))
    eval_rows: list[dict[str, Any]] = []
    eval_numbers: list[int] = []
    if eval_path is not None:
        eval_rows, _ = read_checked_rows(eval_path, ds, "evaluation", max_decompressed_bytes, check)
        eval_numbers = list(range(1, len(eval_rows) + 1))
    elif ds.eval_split > 0:
        tr, ev = split_for_eval(len(rows), ds.eval_split, spec.training.seed)
        eval_rows, eval_numbers = [rows[i] for i in ev], [i + 1 for i in ev]
        rows, numbers = [rows[i] for i in tr], [i + 1 for i in tr]

    def wrap(part: list[dict[str, Any]], nums: list[int]) -> TokenizedDataset:
        examples = [
            {
                "prompt": item_of(r, ds.messages_field)[ds.messages_field],
                ITEM_COLUMN: json.dumps(item_of(r, ds.messages_field), ensure_ascii=False),
                ROW_COLUMN: n,
            }
            for r, n in zip(part, nums, strict=True)
        ]
        return TokenizedDataset(examples, DataStats(rows=len(part), examples=len(part)))

    return Datasets(
        train=wrap(rows, numbers),
        eval=wrap(eval_rows, eval_numbers) if eval_rows else None,
        labels=None,
    )
