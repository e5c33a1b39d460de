"""Reading and checking dataset files: JSONL, CSV, Parquet, or a directory of them.

Used at upload (count rows, list columns), at submit (does every row have what the format
needs?) and by the trainer (the rows it trains on). Checking at submit is the point: a data
error must be found before a GPU is touched. Problems name the file row (1-based) and field.

Pure: no torch, no web code.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.spec import DatasetSpec

SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
MAX_REPORTED_PROBLEMS = 20


class DataFileError(ValueError):
    """The file cannot be read as a dataset at all (wrong format, broken JSON line, ...)."""

    def __init__(self, message: str, *, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row = row


@dataclass
class DataProblem:
    row: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = []
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        return f"{', '.join(where)}: {self.message}" if where else self.message


@dataclass
class FileInfo:
    format: str
    rows: int
    columns: list[str]


@dataclass
class DataReport:
    rows: int = 0
    problems: list[DataProblem] = field(default_factory=list)
    problem_count: int = 0
    labels: list[str] = field(default_factory=list)

    def add(self, problem: DataProblem) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(problem)


def detect_format(path: Path) -> str:
    fmt = SUFFIX_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataFileError(
            f"unsupported file type {path.suffix!r}; use .jsonl, .csv or .parquet"
        )
    return fmt


def data_files(path: Path) -> list[Path]:
    """The files a dataset path stands for: itself, or the supported files of a directory."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIX_FORMATS)
        if not files:
            raise DataFileError(f"directory {path.name!r} holds no .jsonl, .csv or .parquet file")
        return files
    return [path]


def iter_rows(path: Path, fmt: str | None = None) -> Iterator[dict[str, Any]]:
    """Rows as dicts, in file order, streaming (never the whole file in memory for JSONL/CSV)."""
    for file in data_files(path):
        yield from _iter_file(file, fmt or detect_format(file))


def _iter_file(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """Rows of one file; any decoding problem becomes a DataFileError naming the row."""
    row = 0
    try:
        for row, rec in enumerate(_iter_file_raw(path, fmt), start=1):
            yield rec
    except csv.Error as e:
        raise DataFileError(f"not valid CSV ({e})", row=row + 1) from None


def _decoded_lines(f: Any) -> Iterator[str]:
    # Decode line by line (not in buffer-sized chunks) so an error names its line.
    for n, raw in enumerate(f, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataFileError("not UTF-8 text", row=n) from None


def _iter_file_raw(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    if fmt == "jsonl":
        with open(path, "rb") as f:
            row = 0
            for line in _decoded_lines(f):
                if not line.strip():
                    continue
                row += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataFileError(f"not valid JSON ({e.msg})", row=row) from None
                if not isinstance(obj, dict):
                    raise DataFileError("each line must be a JSON object", row=row)
                yield obj
    elif fmt == "csv":
        with open(path, "rb") as f:
            reader = csv.DictReader(_decoded_lines(f))
            if not reader.fieldnames:
                raise DataFileError("CSV has no header row")
            for i, rec in enumerate(reader, start=1):
                if None in rec:
                    raise DataFileError("more values than header columns", row=i)
                yield dict(rec)
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise DataFileError(f"not a readable Parquet file ({e})") from None
        for batch in pf.iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        raise DataFileError(f"unknown format {fmt!r}")


def inspect_file(path: Path, max_rows: int | None = None) -> FileInfo:
    """Count rows and collect column names; raise DataFileError on unreadable content."""
    fmt = detect_format(path)
    columns: dict[str, None] = {}
    rows = 0
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - as in iter_rows: any failure is a bad file
            raise DataFileError(f"not a readable Parquet file ({e})") from None
        rows = pf.metadata.num_rows
        columns = dict.fromkeys(pf.schema_arrow.names)
    else:
        for rec in _iter_file(path, fmt):
            rows += 1
            if max_rows is not None and rows > max_rows:
                raise DataFileError(f"more than {max_rows} rows")
            for k in rec:
                columns.setdefault(k, None)
    if max_rows is not None and rows > max_rows:
        raise DataFileError(f"more than {max_rows} rows")
    if rows == 0:
        raise DataFileError("the file holds no rows")
    return FileInfo(format=fmt, rows=rows, columns=list(columns))


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def check_rows(path: Path, ds: DatasetSpec) -> DataReport:
    """Check every row against what ``ds.format`` needs. Never raises for row problems."""
    report = DataReport()
    labels: dict[str, None] = {}
    try:
        for row, rec in enumerate(iter_rows(path), start=1):
            report.rows += 1
            for problem in _row_problems(rec, ds):
                problem.row = row
                report.add(problem)
            if ds.format == "classification" and ds.label_field in rec:
                lab = rec[ds.label_field]
                if isinstance(lab, (str, int)) and not isinstance(lab, bool):
                    labels.setdefault(str(lab), None)
    except DataFileError as e:
        report.add(DataProblem(e.row, None, str(e).split(": ", 1)[-1]))
    if report.rows == 0 and report.problem_count == 0:
        report.add(DataProblem(None, None, "the dataset holds no rows"))
    if ds.format == "classification":
        report.labels = sorted(labels)
        if len(report.labels) == 1:
            report.add(DataProblem(None, ds.label_field, "only one label value in the data"))
    return report


def _row_problems(rec: dict[str, Any], ds: DatasetSpec) -> list[DataProblem]:
    out: list[DataProblem] = []

    def need_text(name: str) -> None:
        if name not in rec or rec[name] is None:
            out.append(DataProblem(None, name, "missing"))
        elif not isinstance(rec[name], str):
            out.append(DataProblem(None, name, f"must be text, got {type(rec[name]).__name__}"))
        elif not _is_text(rec[name]):
            out.append(DataProblem(None, name, "empty text"))

    if ds.format == "text":
        need_text(ds.text_field)
    elif ds.format == "prompt_completion":
        need_text(ds.prompt_field)
        need_text(ds.completion_field)
    elif ds.format == "seq2seq":
        need_text(ds.input_field)
        need_text(ds.target_field)
    elif ds.format == "classification":
        need_text(ds.text_field)
        lab = rec.get(ds.label_field)
        if lab is None or lab == "":
            out.append(DataProblem(None, ds.label_field, "missing"))
        elif isinstance(lab, bool) or not isinstance(lab, (str, int)):
            out.append(DataProblem(None, ds.label_field, "must be a string or an integer"))
    elif ds.format == "chat":
        msgs = rec.get(ds.messages_field)
        if isinstance(msgs, str):  # CSV cells hold JSON text
            try:
                msgs = json.loads(msgs)
            except json.JSONDecodeError:
                msgs = None
        if not isinstance(msgs, list) or not msgs:
            out.append(DataProblem(None, ds.messages_field, "must be a non-empty list of messages"))
        else:
            roles = []
            for i, m in enumerate(msgs):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    out.append(
                        DataProblem(None, f"{ds.messages_field}[{i}]", "needs role and content")
                    )
                    break
                if not isinstance(m.get("content"), str):
                    out.append(
                        DataProblem(None, f"{ds.messages_field}[{i}].content", "must be text")
                    )
                    break
                roles.append(m["role"])
            if roles and "assistant" not in roles:
                out.append(DataProblem(None, ds.messages_field, "no assistant turn to learn"))
    return out
