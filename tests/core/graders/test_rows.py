"""GRPO rows at submit: a prompt whose last message is the user's, and every item field a
grader references, in every row; problems name the row and the field."""

from __future__ import annotations

from pathlib import Path

from core.data.files import check_rows
from core.data.grpo import grpo_row_check
from core.spec import DatasetSpec
from core.spec.graders import parse_grader
from tests.utils.tiny import write_jsonl

GRADER = parse_grader({"type": "string_check", "name": "c", "input": "{{sample.output_text}}",
                       "reference": "{{item.answer}}", "operation": "eq"})


def test_each_bad_row_is_named_with_its_field(tmp_path: Path) -> None:
    rows = [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
        {"messages": [{"role": "user", "content": "3+3?"}]},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "4"}],
         "answer": "4"},
        {"prompt": "no messages", "answer": "4"},
        {"messages": [{"role": "robot", "content": "x"}], "answer": "4"},
    ]
    ds = DatasetSpec(path="x", format="chat")
    report = check_rows(write_jsonl(tmp_path / "d.jsonl", rows), ds,
                        row_check=grpo_row_check(ds, GRADER))
    found = {(p.row, p.field): p.message for p in report.problems}
    assert set(found) == {(2, "answer"), (3, "messages"), (4, "messages"), (5, "messages[0]")}
    assert "{{item.answer}}" in found[(2, "answer")]
    assert "last message is from assistant" in found[(3, "messages")]
