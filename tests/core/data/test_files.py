"""Dataset file checks: problems name the row and the field."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from core.data import files as datafiles
from core.data import reading
from core.data.files import check_rows, inspect_file
from core.data.reading import DataFileError, iter_rows
from core.spec import DatasetSpec
from tests.utils.savedisk import save_to_disk


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
    p = write(tmp_path / "d.jsonl", '{"text": 1}\n' * 50)
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


# --------------------------------------------------------------------------- JSON arrays


def test_json_array_rows_and_columns(tmp_path: Path) -> None:
    p = write(tmp_path / "d.json", ' \n[{"text": "a"},\n {"text": "b", "x": 1}]\n')
    info = inspect_file(p)
    assert (info.format, info.rows, info.columns) == ("json", 2, ["text", "x"])


def test_json_array_is_found_by_content_not_by_name(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl", '[{"text": "a"}, {"text": "b"}, {"text": "c"}]')
    assert inspect_file(p).rows == 3


def test_json_array_bad_element_names_the_element(tmp_path: Path) -> None:
    p = write(tmp_path / "d.json", '[{"text": "a"}, {"text": "b"}, {"text": broken}]')
    with pytest.raises(DataFileError, match=r"row 3: not valid JSON"):
        inspect_file(p)


def test_json_array_element_that_is_not_an_object(tmp_path: Path) -> None:
    p = write(tmp_path / "d.json", '[{"text": "a"}, ["text"]]')
    with pytest.raises(DataFileError, match="row 2: each element must be a JSON object"):
        inspect_file(p)


def test_json_array_not_closed(tmp_path: Path) -> None:
    p = write(tmp_path / "d.json", '[{"text": "a"}, {"text": "b"}')
    with pytest.raises(DataFileError, match=r"not valid JSON \(the array is not closed\)"):
        inspect_file(p)


def test_json_array_missing_field_names_row_and_field(tmp_path: Path) -> None:
    p = write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": "b"}, {"body": "c"}]))
    report = check_rows(p, DatasetSpec(file_id="f"))
    assert [str(x) for x in report.problems] == ["row 3, field 'text': missing"]


def test_json_array_elements_larger_than_a_read_chunk(tmp_path: Path) -> None:
    rows = [{"text": "x" * 3_000_000, "i": i} for i in range(3)] + [{"text": "y"}] * 1000
    p = write(tmp_path / "d.json", json.dumps(rows))
    assert [r.get("i") for r in iter_rows(p)][:4] == [0, 1, 2, None]
    assert inspect_file(p).rows == 1003


def test_json_array_element_over_the_row_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reading, "MAX_ROW_BYTES", 2_000_000)
    p = write(tmp_path / "d.json", json.dumps([{"text": "a"}, {"text": "x" * 5_000_000}]))
    with pytest.raises(DataFileError, match="row 2: an element is longer than the limit"):
        inspect_file(p)


# --------------------------------------------------------------------------- gzip


def test_gzipped_jsonl_and_json_array(tmp_path: Path) -> None:
    lines = tmp_path / "d.jsonl.gz"
    lines.write_bytes(gzip.compress(b'{"text": "a"}\n{"text": "b"}\n'))
    array = tmp_path / "e.json.gz"
    array.write_bytes(gzip.compress(b'[{"text": "a"}, {"text": "b"}, {"text": "c"}]'))
    assert (inspect_file(lines).format, inspect_file(lines).rows) == ("jsonl.gz", 2)
    assert (inspect_file(array).format, inspect_file(array).rows) == ("json.gz", 3)
    assert check_rows(array, DatasetSpec(file_id="f")).problems == []


def test_gzip_bomb_is_refused_naming_the_limit(tmp_path: Path) -> None:
    p = tmp_path / "bomb.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "a"}\n' + b" " * (20 << 20)))
    assert p.stat().st_size < 64 * 1024
    with pytest.raises(DataFileError, match="past the limit of 1048576 decompressed bytes"):
        inspect_file(p, max_decompressed_bytes=1 << 20)
    report = check_rows(p, DatasetSpec(file_id="f"), max_decompressed_bytes=1 << 20)
    assert "1048576 decompressed bytes" in report.problems[0].message


def test_gz_name_without_gzip_content(tmp_path: Path) -> None:
    p = write(tmp_path / "d.jsonl.gz", '{"text": "a"}\n')
    with pytest.raises(DataFileError, match="not gzip data"):
        inspect_file(p)


def test_truncated_gzip_is_a_data_error(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:-30])
    with pytest.raises(DataFileError, match="not valid gzip data"):
        inspect_file(p)


# --------------------------------------------------------------------------- save_to_disk


CHAT = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
    for i in range(5)
]


def test_saved_dataset_is_read_shard_by_shard(tmp_path: Path) -> None:
    d = save_to_disk(tmp_path / "ds", CHAT, shards=2)
    assert [r["messages"][0]["content"] for r in iter_rows(d)] == [f"q{i}" for i in range(5)]
    report = check_rows(d, DatasetSpec(path=str(d), format="chat"))
    assert (report.rows, report.problems) == (5, [])


def test_saved_dataset_row_problem_names_row_and_field(tmp_path: Path) -> None:
    d = save_to_disk(tmp_path / "ds", [{"text": "a"}, {"text": ""}, {"text": "c"}])
    report = check_rows(d, DatasetSpec(path=str(d)))
    assert [str(x) for x in report.problems] == ["row 2, field 'text': empty text"]


def test_saved_dataset_dict_asks_for_one_split(tmp_path: Path) -> None:
    d = tmp_path / "dd"
    save_to_disk(d / "train", CHAT)
    (d / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    report = check_rows(d, DatasetSpec(path=str(d), format="chat"))
    assert "DatasetDict (splits: train); give the directory of one split" in str(report.problems[0])
    assert check_rows(d / "train", DatasetSpec(path=str(d), format="chat")).rows == 5


def test_saved_dataset_file_names_cannot_leave_the_directory(tmp_path: Path) -> None:
    d = save_to_disk(tmp_path / "ds", CHAT)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../x.arrow"}]}))
    with pytest.raises(DataFileError, match="is not a file name"):
        list(iter_rows(d))


def test_saved_dataset_shard_symlinked_outside_is_refused(tmp_path: Path) -> None:
    outside = save_to_disk(tmp_path / "elsewhere", CHAT)
    d = save_to_disk(tmp_path / "ds", CHAT)
    shard = d / "data-00000-of-00001.arrow"
    shard.unlink()
    shard.symlink_to(outside / "data-00000-of-00001.arrow")
    with pytest.raises(DataFileError, match="points outside the directory"):
        list(iter_rows(d))


def test_saved_dataset_shard_that_is_not_an_arrow_stream(tmp_path: Path) -> None:
    d = save_to_disk(tmp_path / "ds", CHAT)
    (d / "data-00000-of-00001.arrow").write_bytes(b"not arrow at all")
    report = check_rows(d, DatasetSpec(path=str(d), format="chat"))
    assert "not a readable Arrow stream" in report.problems[0].message


def test_every_bad_jsonl_row_is_named_not_only_the_first(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"row {i}"}) for i in range(1, 41)]
    for row in (6, 19, 33):
        lines[row - 1] = '{"text": "unterminated'
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError) as e:
        inspect_file(path)
    assert str(e.value) == (
        "3 of 40 rows are not JSON objects: row 6: not valid JSON (Invalid control "
        "character at); row 19: not valid JSON (Invalid control character at); row 33: not "
        "valid JSON (Invalid control character at)")


def test_bad_jsonl_rows_are_listed_up_to_the_cap_then_counted(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join("1\n" for _ in range(datafiles.MAX_REPORTED_PROBLEMS + 5)))
    with pytest.raises(DataFileError) as e:
        inspect_file(path)
    message = str(e.value)
    assert message.count("each line must be a JSON object") == datafiles.MAX_REPORTED_PROBLEMS
    assert message.endswith("; and 5 more")
