"""check_rows for the preference and kto formats: each bad row named with its field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.data.files import check_rows
from core.spec import DatasetSpec


def problems(tmp_path: Path, rows: list[dict[str, Any]], fmt: str, **fields: str) -> list[str]:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_rows(path, DatasetSpec(file_id="f", format=fmt, **fields))  # type: ignore[arg-type]
    return [str(p) for p in report.problems]


USER = [{"role": "user", "content": "q"}]
PAIR_MESSAGE = "a pair must prefer one answer over a different one"


def test_pairs_of_text_or_messages_pass(tmp_path: Path) -> None:
    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "b"},
        # A messages prompt; answers as text (one assistant turn) or as messages.
        {"prompt": USER, "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
    ]
    assert problems(tmp_path, rows, "preference") == []


def test_bad_pairs_name_row_and_field(tmp_path: Path) -> None:
    rows = [
        {"prompt": "q", "rejected": "b"},
        {"prompt": "", "chosen": "a", "rejected": "b"},
        {"prompt": "q", "chosen": "same", "rejected": "same"},
        {"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
        {"prompt": USER, "chosen": [{"role": "assistant"}], "rejected": "b"},
        {"prompt": "q", "chosen": 3, "rejected": "b"},
    ]
    assert problems(tmp_path, rows, "preference") == [
        "row 1, field 'chosen': missing",
        "row 2, field 'prompt': empty",
        "row 3, field 'rejected': identical to 'chosen': " + PAIR_MESSAGE,
        "row 4, field 'chosen': must be text: the prompt is text, not messages",
        "row 5, field 'chosen[0].content': must be non-empty text",
        "row 6, field 'chosen': must be text or a list of messages, got int",
    ]


def test_field_names_follow_the_spec(tmp_path: Path) -> None:
    rows = [{"question": "q", "good": "a", "bad": "a"}]
    got = problems(
        tmp_path, rows, "preference", prompt_field="question", chosen_field="good",
        rejected_field="bad",
    )
    assert got == ["row 1, field 'bad': identical to 'good': " + PAIR_MESSAGE]


def test_kto_rows_need_a_boolean_label(tmp_path: Path) -> None:
    rows = [
        {"prompt": "q", "completion": "a", "label": True},
        {"prompt": "q", "completion": "a", "label": "False"},  # CSV cells are text
        {"prompt": "q", "completion": "a", "label": 0},
        {"prompt": "q", "completion": "a"},
        {"prompt": "q", "completion": " ", "label": False},
    ]
    assert problems(tmp_path, rows, "kto") == [
        "row 3, field 'label': must be true or false, got 0",
        "row 4, field 'label': missing",
        "row 5, field 'completion': empty text",
    ]


def test_csv_cells_holding_messages_are_read_as_messages(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    cell = json.dumps(USER).replace('"', '""')
    path.write_text(f'prompt,chosen,rejected\n"{cell}",a,b\n')
    report = check_rows(path, DatasetSpec(file_id="f", format="preference"))
    assert report.problems == [] and report.conversational
