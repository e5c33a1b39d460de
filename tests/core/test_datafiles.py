"""Dataset file checks: problems name the row and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.datafiles import DataFileError, check_rows, inspect_file
from core.spec import DatasetSpec


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_jsonl_rows_and_columns(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '{"text": "a"}\n\n{"text": "b", "x": 1}\n')
    info = inspect_file(p)
    assert (info.format, info.rows, info.columns) == ("jsonl", 2, ["text", "x"])


def test_csv_rows_and_columns(tmp_path: Path) -> None:
    p = write(tmp_path / "d.csv", "prompt,completion\nhi,there\nyo,ok\n")
    assert inspect_file(p).rows == 2


def test_parquet_rows_and_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c"]}), p)
    info = inspect_file(p)
    assert (info.rows, info.columns) == (3, ["text"])


def test_broken_json_line_names_the_row(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '{"text": "a"}\n{"text": \n')
    with pytest.raises(DataFileError, match="row 2"):
        inspect_file(p)


def test_row_limit_is_enforced(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", "".join(json.dumps({"text": "a"}) + "\n" for _ in range(5)))
    with pytest.raises(DataFileError, match="more than 3 rows"):
        inspect_file(p, max_rows=3)


def test_unsupported_suffix(tmp_path: Path) -> None:
    with pytest.raises(DataFileError, match="unsupported"):
        inspect_file(write(tmp_path / "d.txt", "x"))


def test_missing_field_names_row_and_field(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '{"text": "a"}\n{"body": "b"}\n')
    report = check_rows(p, DatasetSpec(file_id="f"))
    assert [str(x) for x in report.problems] == ["row 2, field 'text': missing"]


def test_empty_and_wrong_type_text(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '{"text": "  "}\n{"text": 3}\n')
    report = check_rows(p, DatasetSpec(file_id="f"))
    assert [x.message for x in report.problems] == ["empty text", "must be text, got int"]


def test_classification_labels_are_collected(tmp_path: Path) -> None:
    p = write(
        tmp_path / "d.jsonl",
        '{"text": "a", "label": "pos"}\n{"text": "b", "label": "neg"}\n',
    )
    report = check_rows(p, DatasetSpec(file_id="f", format="classification"))
    assert report.problems == [] and report.labels == ["neg", "pos"]


def test_chat_needs_an_assistant_turn(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    report = check_rows(p, DatasetSpec(file_id="f", format="chat"))
    assert report.problems[0].message == "no assistant turn to learn"


def test_problem_list_is_capped_but_counted(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '{"x": 1}\n' * 50)
    report = check_rows(p, DatasetSpec(file_id="f"))
    assert len(report.problems) == 20 and report.problem_count == 50


def test_directory_of_files(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    write(d / "a.jsonl", '{"text": "a"}\n')
    write(d / "b.csv", "text\nb\n")
    assert check_rows(d, DatasetSpec(path=str(d))).rows == 2


def test_non_utf8_names_the_row(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "a"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataFileError, match="row 2: not UTF-8"):
        inspect_file(p)


def test_broken_csv_is_a_data_error(tmp_path: Path) -> None:
    p = write(tmp_path / "d.csv", 'text\n"a\x00b"\n')
    report = check_rows(p, DatasetSpec(file_id="f"))
    assert report.problem_count >= 0  # never raises
