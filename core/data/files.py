"""Checking dataset files (read by core/data/reading.py): what an upload holds, and whether
every row has what the format needs.

Used at upload (count rows, list columns), at submit (does every row have what the format
needs?) and by the trainer (the rows it trains on). Checking at submit is the point: a data
error must be found before a GPU is touched. Problems name the file row (1-based) and field;
in a JSON array, row N is the Nth element.

Pure: no torch, no web code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.data.formats import Problems, Receipt, Resolution, allowed_formats, did_you_mean, resolve
from core.data.formats.base import DataProblem
from core.data.formats.detect import FormatError, detect_upload
from core.data.reading import (
    MAX_REPORTED_PROBLEMS,
    BadRow,
    DataFileError,
    arrow_batches,
    detect_format,
    iter_file,
    iter_rows,
)
from core.spec import DatasetSpec

# Detection reads the columns of this many first rows (and keeps a few as shape samples).
DETECT_ROWS = 1000
_SAMPLE_ROWS = 20


@dataclass
class FileInfo:
    format: str
    rows: int
    columns: list[str]
    # What the rows hold (core/data/formats/detect.py detect_upload): read from the first rows as
    # submit's check reads them, so the upload says what format auto will find.
    detected: dict[str, Any] | None = None


@dataclass
class DataReport:
    rows: int = 0
    problems: list[DataProblem] = field(default_factory=list)
    problem_count: int = 0
    labels: list[str] = field(default_factory=list)
    # preference/kto: some prompt is a list of messages (rendered with the chat template).
    conversational: bool = False
    # The layout read (None when no format fits) and what was used and ignored.
    resolution: Resolution | None = None
    receipt: Receipt | None = None

    def add(self, problem: DataProblem) -> None:
        self.problem_count += 1
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(problem)


def inspect_file(
    path: Path, max_rows: int | None = None, *, max_decompressed_bytes: int | None = None
) -> FileInfo:
    """Count rows and collect column names; raise DataFileError on unreadable content."""
    fmt = detect_format(path, max_decompressed_bytes)
    columns: dict[str, None] = {}
    # The first rows, as check_rows reads them for detection (bounded: _SAMPLE_ROWS rows
    # kept, the columns of DETECT_ROWS).
    head_columns: dict[str, None] = {}
    sample: list[dict[str, Any]] = []
    rows = 0
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            rows = pf.metadata.num_rows
            columns = dict.fromkeys(pf.schema_arrow.names)
            first = next(pf.iter_batches(batch_size=_SAMPLE_ROWS), None)
        except Exception as e:  # noqa: BLE001 - as in iter_rows: any failure is a bad file
            raise DataFileError(f"not a readable Parquet file ({e})") from None
        head_columns = columns
        sample = first.to_pylist() if first is not None else []
    elif fmt == "arrow":
        for batch in arrow_batches(path):
            if not sample:
                sample = batch.slice(0, _SAMPLE_ROWS).to_pylist()
            rows += batch.num_rows
            columns = dict.fromkeys(batch.schema.names)
        head_columns = columns
    else:
        for rec in iter_file(path, fmt, max_decompressed_bytes):
            rows += 1
            if max_rows is not None and rows > max_rows:
                raise DataFileError(f"more than {max_rows} rows")
            for k in rec:
                columns.setdefault(k, None)
            if rows <= DETECT_ROWS:
                head_columns.update(dict.fromkeys(rec))
                if len(sample) < _SAMPLE_ROWS:
                    sample.append(rec)
    if max_rows is not None and rows > max_rows:
        raise DataFileError(f"more than {max_rows} rows")
    if rows == 0:
        raise DataFileError("the file holds no rows")
    detected = detect_upload([str(c) for c in head_columns], sample)
    return FileInfo(format=fmt, rows=rows, columns=list(columns), detected=detected)


def check_rows(
    path: Path,
    ds: DatasetSpec,
    *,
    allowed: tuple[str, ...] | None = None,
    max_decompressed_bytes: int | None = None,
    row_check: Callable[[dict[str, Any]], list[DataProblem]] | None = None,
    keep: list[tuple[int, Any]] | None = None,
) -> DataReport:
    """``row_check``: where the objective decides what a row is (grpo:
    core/data/grpo.py), every row goes through it instead of a layout's converter.

    ``keep``: (1-based row, example) of every row that converted is appended to it (the
    trainer holds the examples anyway: one pass over the file instead of a second one
    through iter_examples).

    Otherwise: resolve the layout (core/data/formats: ``ds.format``, or detection among ``allowed``) and
    convert every row with its converter; never raises for row problems.

    Problems are counted over the whole file (a broken JSON line does not stop the check)
    and the first MAX_REPORTED_PROBLEMS are kept; a column missing from every row is one
    problem naming the columns the rows have."""
    report = DataReport()
    if row_check is not None:
        _check_each(path, row_check, report, max_decompressed_bytes)
        return report
    if allowed is None:
        allowed = allowed_formats("causal_lm", "sft") if ds.format == "auto" else (ds.format,)
    columns: dict[str, None] = {}
    sample: list[dict[str, Any]] = []
    try:
        rows = iter_rows(path, max_decompressed_bytes=max_decompressed_bytes, tolerant=True)
        for i, rec in enumerate(rows):
            if i >= DETECT_ROWS:
                break
            if not isinstance(rec, BadRow):
                columns.update(dict.fromkeys(rec))
                if len(sample) < _SAMPLE_ROWS:
                    sample.append(rec)
    except DataFileError:
        pass  # the full pass below reports it where it happens
    res: Resolution | None = None
    if columns:
        try:
            res = resolve(ds, allowed, list(columns), sample)
        except FormatError as e:
            for p in e.problems:
                report.add(p)
    _check_all(path, ds, res, report, max_decompressed_bytes, keep)
    if report.rows == 0 and report.problem_count == 0:
        report.add(DataProblem(None, None, "the dataset holds no rows"))
    return report


def _check_each(
    path: Path,
    row_check: Callable[[dict[str, Any]], list[DataProblem]],
    report: DataReport,
    max_decompressed_bytes: int | None,
) -> None:
    try:
        rows = iter_rows(path, max_decompressed_bytes=max_decompressed_bytes, tolerant=True)
        for row, rec in enumerate(rows, start=1):
            report.rows += 1
            found = [DataProblem(None, None, rec.message)] if isinstance(rec, BadRow) else row_check(rec)
            for problem in found:
                problem.row = row
                report.add(problem)
    except DataFileError as e:
        report.add(DataProblem(e.row, None, e.message))
    if report.rows == 0 and report.problem_count == 0:
        report.add(DataProblem(None, None, "the dataset holds no rows"))


def _check_all(
    path: Path,
    ds: DatasetSpec,
    res: Resolution | None,
    report: DataReport,
    max_decompressed_bytes: int | None,
    keep: list[tuple[int, Any]] | None = None,
) -> None:
    """Every row through the resolved converter (or only counted, without one)."""
    # Required columns absent from every row so far: column -> first rows, count.
    missing: dict[str, list[int]] = {}
    missing_count: dict[str, int] = {}
    pending: dict[str, list[int]] = {}
    all_columns: dict[str, None] = {}
    labels: dict[str, None] = {}
    try:
        rows = iter_rows(path, max_decompressed_bytes=max_decompressed_bytes, tolerant=True)
        for row, rec in enumerate(rows, start=1):
            report.rows += 1
            if isinstance(rec, BadRow):
                report.add(DataProblem(row, None, rec.message))
                continue
            all_columns.update(dict.fromkeys(rec))
            if res is None:
                continue
            absent = [res.columns[r] for r in res.layout.required if res.columns[r] not in rec]
            for c in res.layout.required:
                column = res.columns[c]
                if column in rec and column in pending:
                    # Some row has it after all: the rows before that lacked it are named.
                    for r in pending.pop(column):
                        report.add(DataProblem(r, column, "missing", res.param_of(column)))
                    report.problem_count += missing_count.pop(column) - len(missing[column])
            for c in absent:
                if c in pending or (c not in missing_count and row == 1):
                    # Missing from every row so far: held back, maybe one problem in the end.
                    missing_count[c] = missing_count.get(c, 0) + 1
                    missing.setdefault(c, [])
                    if len(missing[c]) < MAX_REPORTED_PROBLEMS:
                        missing[c].append(row)
                    pending[c] = missing[c]
                else:
                    report.add(DataProblem(row, c, "missing", res.param_of(c)))
            if absent:
                continue
            out = Problems()
            example = res.layout.convert(rec, res.columns, ds, out)
            for p in out.items:
                p.row = row
                p.param = res.param_of((p.field or "").split("[", 1)[0].split(".", 1)[0])
                report.add(p)
            if example is None:
                continue
            if keep is not None:
                keep.append((row, example))
            if res.layout.format in ("preference", "kto"):
                report.conversational = report.conversational or isinstance(
                    example["prompt"], list
                )
            elif res.layout.format == "classification":
                labels.setdefault(example["label"], None)
    except DataFileError as e:
        report.add(DataProblem(e.row, None, e.message))
    present = list(all_columns)
    for column in pending:
        report.add(DataProblem(
            None, column,
            f"no row has a column {column!r}{did_you_mean(column, present)}; the rows "
            f"have {', '.join(present) or 'no columns'}",
            res.param_of(column) if res is not None else None,
        ))
    report.problems.sort(key=lambda p: -1 if p.row is None else p.row)
    if res is not None:
        report.resolution = res
        report.receipt = res.receipt(present)
        report.receipt.rows = report.rows
        if res.layout.format == "classification":
            report.labels = sorted(labels)
            if len(report.labels) == 1:
                report.add(DataProblem(
                    None, res.columns["label"], "only one label value in the data",
                    res.params["label"],
                ))


def iter_examples(
    path: Path,
    ds: DatasetSpec,
    res: Resolution,
    *,
    max_decompressed_bytes: int | None = None,
) -> Iterator[tuple[int, Any]]:
    """(1-based row, converted example) for every row, streaming, through the converter
    check_rows resolved. A row that no longer converts (the file changed since the check)
    raises DataFileError naming it."""
    for row, rec in enumerate(iter_rows(path, max_decompressed_bytes=max_decompressed_bytes), 1):
        out = Problems()
        example = res.layout.convert(rec, res.columns, ds, out)
        if example is None:
            first = out.items[0] if out.items else DataProblem(None, None, "cannot be read")
            raise DataFileError(str(first), row=row)
        yield row, example
