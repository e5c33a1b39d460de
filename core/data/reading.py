"""Reading dataset files: JSONL, a JSON array, either gzip-compressed, CSV, Parquet, a
directory of such files, or a directory written by ``datasets.save_to_disk``; rows one at a
time, whatever the file size.

Memory stays bounded whatever the file size: JSON lines and array elements are read one at a
time (an element or line may hold at most MAX_ROW_BYTES), gzip is decompressed as a stream
and refused past a limit on decompressed bytes (a small file must not expand into an
unbounded one), Parquet and Arrow are read one record batch at a time. What the rows must
hold is checked in core/data/files.py.

Pure: no torch, no web code.
"""

from __future__ import annotations

import codecs
import csv
import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

# Known file name endings, longest first so that ".jsonl.gz" wins over ".gz".
SUFFIX_FORMATS = {
    ".jsonl.gz": "jsonl",
    ".json.gz": "jsonl",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
MAX_REPORTED_PROBLEMS = 20  # rows named in a report (the rest counted)
SUPPORTED = ".jsonl, .json (lines or one array), .jsonl.gz, .json.gz, .csv or .parquet"
# One JSON line or array element; a fine-tuning example is far smaller (max_seq_length is
# at most 131,072 tokens). Bounds what one row may hold in memory while streaming.
MAX_ROW_BYTES = 64 << 20
# gzip data expanding past this is refused; the API passes its own limit
# (settings.max_decompressed_bytes), this default is 8 x the default upload limit.
DEFAULT_MAX_DECOMPRESSED_BYTES = 8 << 30
# datasets.save_to_disk writes these beside the data-*.arrow shards.
STATE_JSON = "state.json"
DATASET_DICT_JSON = "dataset_dict.json"
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20
_GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)


class DataFileError(ValueError):
    """The file cannot be read as a dataset at all (wrong format, broken JSON line, ...)."""

    def __init__(self, message: str, *, row: int | None = None) -> None:
        super().__init__(message if row is None else f"row {row}: {message}")
        self.row = row
        self.message = message


def known_suffix(name: str) -> str | None:
    """The supported ending of a file name (".jsonl.gz", ".csv", ...), or None."""
    lower = name.lower()
    return next((s for s in SUFFIX_FORMATS if lower.endswith(s)), None)


def detect_format(path: Path, max_decompressed_bytes: int | None = None) -> str:
    """jsonl | json (one array) | jsonl.gz | json.gz | csv | parquet | arrow.

    The name says the family; for JSON the content decides: gzip by its magic bytes, an
    array by its first non-blank character being ``[``."""
    suffix = known_suffix(path.name)
    if suffix is None:
        raise DataFileError(f"unsupported file type {path.suffix!r}; use {SUPPORTED}")
    fmt = SUFFIX_FORMATS[suffix]
    if fmt != "jsonl":
        return fmt
    with open(path, "rb") as f:
        compressed = f.read(2) == _GZIP_MAGIC
    if suffix.endswith(".gz") and not compressed:
        raise DataFileError(f"the name ends in {suffix} but the content is not gzip data")
    try:
        with _open_json(path, compressed, max_decompressed_bytes) as f:
            first = _first_char(f)
    except _GZIP_ERRORS as e:
        raise DataFileError(f"not valid gzip data ({e})") from None
    base = "json" if first == b"[" else "jsonl"
    return f"{base}.gz" if compressed else base


def _first_char(f: IO[bytes]) -> bytes:
    """The first byte that is not JSON whitespace (or a UTF-8 byte order mark)."""
    head = f.read(64 * 1024)
    while head:
        stripped = head.removeprefix(codecs.BOM_UTF8).lstrip(b" \t\r\n")
        if stripped:
            return stripped[:1]
        head = f.read(64 * 1024)
    return b""


def is_saved_dataset(path: Path) -> bool:
    """A directory written by ``datasets`` (Dataset or DatasetDict ``save_to_disk``)."""
    return path.is_dir() and ((path / STATE_JSON).is_file() or (path / DATASET_DICT_JSON).is_file())


def data_files(path: Path) -> list[Path]:
    """The files a dataset path stands for: itself, the data shards of a ``save_to_disk``
    directory, or the supported files of a directory. A file reached through a symlink
    that leaves the directory is refused, as a path outside an allowed root is."""
    if not path.is_dir():
        return [path]
    if is_saved_dataset(path):
        files = _saved_dataset_files(path)
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and known_suffix(p.name))
        if not files:
            raise DataFileError(f"directory {path.name!r} holds no {SUPPORTED} file")
    root = path.resolve()
    for f in files:
        if not f.resolve().is_relative_to(root):
            raise DataFileError(f"{f.name!r} in {path.name!r} points outside the directory")
    return files


def _saved_dataset_files(path: Path) -> list[Path]:
    """The data-*.arrow shards a ``Dataset.save_to_disk`` directory lists in state.json."""
    if (path / DATASET_DICT_JSON).is_file() and not (path / STATE_JSON).is_file():
        splits = _read_json(path / DATASET_DICT_JSON).get("splits") or []
        names = ", ".join(str(s) for s in splits) or "none listed"
        raise DataFileError(
            f"{path.name!r} holds a DatasetDict (splits: {names}); give the directory of one split"
        )
    state = _read_json(path / STATE_JSON)
    if state.get("_indices_data_files"):
        raise DataFileError(
            f"{path.name!r} was saved with an indices mapping (an older datasets version); "
            "save it again after dataset.flatten_indices()"
        )
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise DataFileError(f"{STATE_JSON} in {path.name!r} lists no _data_files")
    files = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name or name != Path(name).name or name == "..":
            raise DataFileError(f"{STATE_JSON} in {path.name!r}: {name!r} is not a file name")
        if not name.endswith(".arrow"):
            raise DataFileError(f"{STATE_JSON} in {path.name!r}: {name!r} is not an .arrow file")
        file = path / name
        if not file.is_file():
            raise DataFileError(f"{name!r} listed in {STATE_JSON} is missing from {path.name!r}")
        files.append(file)
    return files


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(_CHUNK))
    except (OSError, ValueError) as e:
        raise DataFileError(f"{path.name} in {path.parent.name!r} is unreadable ({e})") from None
    if not isinstance(obj, dict):
        raise DataFileError(f"{path.name} in {path.parent.name!r} is not a JSON object")
    return obj


def iter_rows(
    path: Path,
    fmt: str | None = None,
    *,
    max_decompressed_bytes: int | None = None,
    tolerant: bool = False,
) -> Iterator[dict[str, Any]]:
    """Rows as dicts, in file order, streaming (never a whole JSON or CSV file in memory).
    ``tolerant``: a JSON line that does not parse comes as a BadRow instead of an error."""
    for file in data_files(path):
        yield from iter_file(
            file, fmt or detect_format(file, max_decompressed_bytes), max_decompressed_bytes,
            tolerant,
        )


def iter_file(
    path: Path, fmt: str, max_decompressed_bytes: int | None = None, tolerant: bool = False
) -> Iterator[dict[str, Any]]:
    """Rows of one file; any decoding problem becomes a DataFileError naming the row."""
    row = 0
    try:
        rows = iter_file_raw(path, fmt, max_decompressed_bytes, tolerant)
        for row, rec in enumerate(rows, start=1):
            yield rec
    except csv.Error as e:
        raise DataFileError(f"not valid CSV ({e})", row=row + 1) from None
    except _GZIP_ERRORS as e:
        raise DataFileError(f"not valid gzip data ({e})", row=row + 1) from None


class _Limited(io.RawIOBase):
    """Counts what a decompressing reader hands out and stops past the limit."""

    def __init__(self, inner: gzip.GzipFile, limit: int) -> None:
        self.inner, self.limit, self.count = inner, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.inner.read(len(b))
        self.count += len(data)
        if self.count > self.limit:
            raise DataFileError(
                f"the gzip data expands past the limit of {self.limit} decompressed bytes"
            )
        b[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.inner.close()
        super().close()


def _open_json(path: Path, compressed: bool, max_decompressed_bytes: int | None) -> IO[bytes]:
    if not compressed:
        return open(path, "rb")
    limit = max_decompressed_bytes or DEFAULT_MAX_DECOMPRESSED_BYTES
    return io.BufferedReader(_Limited(gzip.GzipFile(path, "rb"), limit), _CHUNK)


def _decoded_lines(f: Any) -> Iterator[str]:
    # Decode line by line (not in buffer-sized chunks) so an error names its line.
    n = 0
    while raw := f.readline(MAX_ROW_BYTES + 1):
        n += 1
        if len(raw) > MAX_ROW_BYTES:
            raise DataFileError(f"a line is longer than the limit of {MAX_ROW_BYTES} bytes", row=n)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataFileError("not UTF-8 text", row=n) from None


class BadRow(dict):  # type: ignore[type-arg]
    """A JSON line that is not an object, in place of its row (``tolerant`` reading): a
    check goes on to the next lines, so one pass names every broken line."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message


def _iter_jsonl(f: IO[bytes], tolerant: bool = False) -> Iterator[dict[str, Any]]:
    """The objects of a JSON Lines file. A line that is not a JSON object does not stop the
    reading: ``tolerant``, it comes as a BadRow in its place; otherwise every such line is
    reported at the end (the first MAX_REPORTED_PROBLEMS), so a file with bad rows 6, 19 and
    33 is fixed in one go, not in three uploads."""
    row = 0
    bad: list[str] = []
    bad_count = 0
    first_bad: int | None = None
    for line in _decoded_lines(f):
        if not line.strip():
            continue
        row += 1
        try:
            obj = json.loads(line)
            problem = None if isinstance(obj, dict) else "each line must be a JSON object"
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg})"
        if problem is None:
            yield obj
            continue
        if tolerant:
            yield BadRow(problem)
            continue
        bad_count += 1
        first_bad = first_bad or row
        if len(bad) < MAX_REPORTED_PROBLEMS:
            bad.append(f"row {row}: {problem}")
    if bad_count == 1:
        raise DataFileError(bad[0].split(": ", 1)[1], row=first_bad)
    if bad_count:
        more = f"; and {bad_count - len(bad)} more" if bad_count > len(bad) else ""
        raise DataFileError(f"{bad_count} of {row} rows are not JSON objects: "
                            f"{'; '.join(bad)}{more}")


_NOT_WS = re.compile(r"[^ \t\r\n]")


class _JsonArray:
    """The objects of one top-level JSON array, one element at a time.

    Holds at most one element plus one read chunk: the text before the current element is
    dropped whenever more is read. An element is decoded by the json module from where it
    starts; when that fails only because the element runs past the text read so far, more is
    read (doubling, so a large element costs linear time) up to MAX_ROW_BYTES.
    """

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decoder = json.JSONDecoder()
        self.buf = ""
        self.pos = 0
        self.eof = False
        self.bad_utf8 = False
        self.row = 0  # elements started so far
        self.in_element = False

    def _more(self, at_least: int = _CHUNK) -> bool:
        if self.eof:
            if self.bad_utf8:
                raise DataFileError("not UTF-8 text", row=self.row + (not self.in_element))
            return False
        data = self.f.read(max(at_least, _CHUNK))
        try:
            text = self.utf8.decode(data, final=not data)
        except UnicodeDecodeError as e:
            # Keep the valid text before the bad byte; the error is raised when the parser
            # needs what follows, so it names the element that holds it.
            text = bytes(e.object[: e.start]).decode("utf-8")
            self.eof = self.bad_utf8 = True
        self.eof = self.eof or not data
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def _peek(self) -> str:
        """The next character that is not JSON whitespace ("" at the end)."""
        while True:
            m = _NOT_WS.search(self.buf, self.pos)
            if m is not None:
                self.pos = m.start()
                return self.buf[self.pos]
            self.pos = len(self.buf)
            if not self._more():
                return ""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        c = self._peek()
        if c == "\ufeff":
            self.pos += 1
            c = self._peek()
        if c != "[":
            raise DataFileError("not a JSON array")
        self.pos += 1
        c = self._peek()
        if c == "]":
            self._end()
            return
        while True:
            self.row += 1
            if c == "":
                raise DataFileError("not valid JSON (the array is not closed)", row=self.row)
            if c != "{":
                raise DataFileError("each element must be a JSON object", row=self.row)
            yield self._element()
            c = self._peek()
            if c == "]":
                self._end()
                return
            if c != ",":
                what = "the array is not closed" if c == "" else "expecting ',' or ']' after it"
                raise DataFileError(f"not valid JSON ({what})", row=self.row)
            self.pos += 1
            c = self._peek()
            if c == "]":
                raise DataFileError("not valid JSON (a ',' before the closing ']')", row=self.row)

    def _end(self) -> None:
        self.pos += 1
        if self._peek() != "":
            raise DataFileError("not valid JSON (more data after the array's closing ']')")

    def _element(self) -> dict[str, Any]:
        self.in_element = True
        while True:
            try:
                obj, self.pos = self.decoder.raw_decode(self.buf, self.pos)
                self.in_element = False
                return obj  # type: ignore[no-any-return]
            except json.JSONDecodeError as e:
                held = len(self.buf) - self.pos
                # Failing well before the end of the text read is a real error; failing at
                # its end (or inside a string running to it) may only mean "read more".
                cut = e.pos >= len(self.buf) - 16 or e.msg.startswith("Unterminated string")
                if not cut or held > MAX_ROW_BYTES or not self._more(at_least=held):
                    if cut and held > MAX_ROW_BYTES:
                        raise DataFileError(
                            f"an element is longer than the limit of {MAX_ROW_BYTES} "
                            "characters (or is not valid JSON)",
                            row=self.row,
                        ) from None
                    raise DataFileError(f"not valid JSON ({e.msg})", row=self.row) from None


def iter_file_raw(
    path: Path, fmt: str, max_decompressed_bytes: int | None = None, tolerant: bool = False
) -> Iterator[dict[str, Any]]:
    if fmt in ("jsonl", "json", "jsonl.gz", "json.gz"):
        with _open_json(path, fmt.endswith(".gz"), max_decompressed_bytes) as f:
            array = fmt.removesuffix(".gz") == "json"
            yield from (_JsonArray(f) if array else _iter_jsonl(f, tolerant))
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
    elif fmt == "arrow":
        for batch in arrow_batches(path):
            yield from batch.to_pylist()
    else:
        raise DataFileError(f"unknown format {fmt!r}")


def arrow_batches(path: Path) -> Iterator[Any]:
    """Record batches of an Arrow IPC stream (what ``datasets`` writes as data-*.arrow),
    memory-mapped: a batch is materialised only when read."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                yield batch
    except pa.ArrowException as e:
        raise DataFileError(f"{path.name} is not a readable Arrow stream ({e})") from None
