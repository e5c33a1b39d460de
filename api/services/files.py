"""Dataset uploads: stream to disk with a size limit, inspect, record; list; delete."""

from __future__ import annotations

import csv
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.requests import Request

from api.openai.errors import mark_openai
from api.schemas import DetectedData, FileDeleted, FileObject, Page
from api.services.pagination import page_after
from core.data.files import inspect_file
from core.data.reading import DataFileError, known_suffix
from core.db.models import File, Job, Tenant, new_id
from core.db.session import after_commit
from core.infra.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.policy import Refused, stored_upload

log = logging.getLogger("ftune.api")

# A JSON file may hold lines or one array; .gz ones are gzip-compressed JSON.
ALLOWED_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".csv", ".parquet")
# Multipart framing around the file (boundaries, part headers, small extra fields).
MULTIPART_SLACK = 64 * 1024
# What an upload's ``purpose`` may be (OpenAI's SDK always sends one).
PURPOSES = ("fine-tune", "evals")
MAX_PURPOSE_BYTES = 64


def safe_filename(raw: str) -> str:
    """The last path component, printable characters only, at most 255 characters."""
    name = raw.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable()).strip()
    if name in ("", ".", ".."):
        raise InvalidRequest("the uploaded file needs a file name", param="file")
    if len(name) > 255:
        suffix = known_suffix(name) or Path(name).suffix[:16]
        name = name[: 255 - len(suffix)] + suffix
    return name


@dataclass
class ReceivedUpload:
    file_id: str
    filename: str
    path: Path
    size: int
    sha256: str
    purpose: str = "fine-tune"


@dataclass
class _Receiver:
    """multipart callbacks: the part named ``file`` goes to disk, everything else is dropped."""

    dest_dir: Path
    max_bytes: int
    file_id: str = field(default_factory=lambda: new_id("file"))
    header_name: bytes = b""
    header_value: bytes = b""
    disposition: bytes = b""
    in_file: bool = False
    seen_file: bool = False
    filename: str = ""
    path: Path | None = None
    out: IO[bytes] | None = None
    size: int = 0
    digest: hashlib._Hash = field(default_factory=hashlib.sha256)
    # OpenAI's SDK sends a ``purpose`` field with the file (before it).
    in_purpose: bool = False
    purpose: bytes | None = None
    request: Request | None = None

    def on_part_begin(self) -> None:
        self.disposition = b""
        self.in_file = self.in_purpose = False

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        if self.header_name.lower() == b"content-disposition":
            self.disposition = self.header_value
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.disposition)
        self.in_purpose = options.get(b"name") == b"purpose"
        if self.in_purpose:
            self.purpose = b""
            if self.request is not None:
                # An OpenAI client: its errors from here on are OpenAI's (400, not 422).
                mark_openai(self.request)
        if options.get(b"name") != b"file":
            return
        if self.seen_file:
            raise InvalidRequest("send exactly one file in the 'file' field", param="file")
        self.seen_file = self.in_file = True
        raw = options.get(b"filename", b"").decode("utf-8", "replace")
        self.filename = safe_filename(raw)
        suffix = known_suffix(self.filename)
        if suffix not in ALLOWED_SUFFIXES:
            raise InvalidRequest(
                f"unsupported file type {Path(self.filename).suffix or self.filename!r}; "
                f"upload {', '.join(ALLOWED_SUFFIXES)}",
                param="file",
            )
        self.dest_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dest_dir / f"{self.file_id}{suffix}"
        self.out = open(self.path, "xb")  # noqa: SIM115 - closed in on_part_end or cleanup

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.in_purpose and self.purpose is not None:
            self.purpose += data[start:end]
            if len(self.purpose) > MAX_PURPOSE_BYTES:
                raise InvalidRequest("purpose: must be 'fine-tune' or 'evals'", param="purpose")
            return
        if not self.in_file or self.out is None:
            return
        chunk = data[start:end]
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise PayloadTooLarge(
                f"the file is larger than the limit of {self.max_bytes} bytes", param="file"
            )
        self.digest.update(chunk)
        self.out.write(chunk)

    def on_part_end(self) -> None:
        if self.in_file and self.out is not None:
            self.out.close()
        self.in_file = self.in_purpose = False

    def cleanup(self) -> None:
        if self.out is not None and not self.out.closed:
            self.out.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)


async def receive_upload(request: Request, settings: Settings, tenant: Tenant) -> ReceivedUpload:
    """Stream the multipart body's ``file`` part to the tenant's upload folder.

    Never holds the body in memory; stops reading with 413 as soon as the limit is passed."""
    content_type = request.headers.get("content-type", "")
    mime, params = parse_options_header(content_type)
    if mime != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidRequest(
            "send the dataset as multipart/form-data with a 'file' field", param="file"
        )
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > settings.max_upload_bytes + MULTIPART_SLACK:
        raise PayloadTooLarge(
            f"the upload is larger than the limit of {settings.max_upload_bytes} bytes",
            param="file",
        )
    rx = _Receiver(settings.uploads_dir / tenant.id, settings.max_upload_bytes)
    rx.request = request
    parser = MultipartParser(
        params[b"boundary"],
        {
            "on_part_begin": rx.on_part_begin,
            "on_part_data": rx.on_part_data,
            "on_part_end": rx.on_part_end,
            "on_header_field": rx.on_header_field,
            "on_header_value": rx.on_header_value,
            "on_header_end": rx.on_header_end,
            "on_headers_finished": rx.on_headers_finished,
        },
    )
    try:
        async for chunk in request.stream():
            parser.write(chunk)
        parser.finalize()
    except FormParserError:
        rx.cleanup()
        raise InvalidRequest("malformed multipart body", param="file") from None
    except BaseException:
        rx.cleanup()
        raise
    if rx.purpose is not None and rx.purpose.decode("utf-8", "replace") not in PURPOSES:
        rx.cleanup()
        raise InvalidRequest(f"purpose: {rx.purpose.decode('utf-8', 'replace')!r} is not "
                             "served here; upload datasets with purpose 'fine-tune', an "
                             "eval's items with purpose 'evals'",
                             param="purpose")
    if rx.path is None:
        raise InvalidRequest("no 'file' field in the multipart body", param="file")
    if rx.out is not None and not rx.out.closed:  # body ended inside the part
        rx.cleanup()
        raise InvalidRequest("malformed multipart body: the file part is incomplete", param="file")
    purpose = rx.purpose.decode() if rx.purpose is not None else "fine-tune"
    return ReceivedUpload(rx.file_id, rx.filename, rx.path, rx.size, rx.digest.hexdigest(),
                          purpose)


def register_upload(
    session: Session, tenant: Tenant, upload: ReceivedUpload, settings: Settings
) -> FileObject:
    """Check the stored upload is a readable dataset and record it. The caller deletes
    the upload if this (or the commit) fails."""
    try:
        info = inspect_file(
            upload.path,
            max_rows=settings.max_upload_rows,
            max_decompressed_bytes=settings.decompressed_limit,
        )
    except DataFileError as e:
        raise InvalidRequest(str(e), code="invalid_dataset", param="file") from None
    except UnicodeDecodeError as e:
        raise InvalidRequest(
            f"not UTF-8 text (byte {e.start} of a line)", code="invalid_dataset", param="file"
        ) from None
    except csv.Error as e:
        raise InvalidRequest(
            f"not a readable CSV file ({e})", code="invalid_dataset", param="file"
        ) from None
    if upload.purpose == "evals":
        _check_item_file(upload, info.format, settings)
    columns = [str(c) for c in info.columns]
    if any("\x00" in c for c in columns):
        raise InvalidRequest(
            "column names must not contain NUL characters", code="invalid_dataset", param="file"
        )
    row = File(
        id=upload.file_id,
        tenant_id=tenant.id,
        filename=upload.filename,
        format=info.format,
        bytes=upload.size,
        rows=info.rows,
        columns=columns,
        sha256=upload.sha256,
        storage_path=str(upload.path.resolve()),
        detected=info.detected if upload.purpose == "fine-tune" else None,
        purpose=upload.purpose,
    )
    session.add(row)
    session.flush()
    return file_object(row)


def _check_item_file(upload: ReceivedUpload, fmt: str, settings: Settings) -> None:
    """An eval's item file: JSON rows {"item": {...}, "sample"?: {...}}, every bad row named
    (the rows meet the eval's item schema when a run names the file)."""
    from core.evals.rows import upload_problems

    if not fmt.startswith("json"):
        raise InvalidRequest(f"an evals file holds JSON rows ({{\"item\": ...}}), not {fmt}",
                             code="invalid_dataset", param="file")
    bad = upload_problems(upload.path, settings.decompressed_limit)
    if bad:
        details = [{"param": "file", "message": f"row {n}: {m}"} for n, m in bad]
        raise InvalidRequest(f"row {bad[0][0]}: {bad[0][1]}" + (
            f" (and {len(bad) - 1} more rows: see details)" if len(bad) > 1 else ""),
            code="invalid_dataset", param="file", details=details)


def file_object(f: File) -> FileObject:
    return FileObject(
        id=f.id,
        filename=f.filename,
        format=f.format,
        bytes=f.bytes,
        rows=f.rows,
        columns=list(f.columns or []),
        sha256=f.sha256,
        created_at=int(f.created_at.timestamp()),
        detected=DetectedData.model_validate(f.detected) if f.detected else None,
        purpose="evals" if f.purpose == "evals" else "fine-tune",
    )


def list_files(session: Session, tenant: Tenant, limit: int, after: str | None,
               purpose: str | None = None) -> Page[FileObject]:
    q = select(File).where(File.tenant_id == tenant.id)
    if purpose is not None:
        q = q.where(File.purpose == purpose)
    rows, has_more = page_after(session, q, File, tenant.id, limit, after)
    return Page(
        data=[file_object(f) for f in rows],
        has_more=has_more,
        next_cursor=rows[-1].id if has_more else None,
    )


def delete_file(session: Session, tenant: Tenant, file: File, settings: Settings) -> FileDeleted:
    """Delete the record and the stored bytes, unless a job that has not finished uses it."""
    active = session.execute(
        select(Job.id, Job.status, Job.spec).where(
            Job.tenant_id == tenant.id, Job.status.in_(jobstate.UNFINISHED)
        )
    ).all()
    for job_id, status, spec in active:
        ds = (spec or {}).get("dataset") or {}
        if file.id in (ds.get("file_id"), ds.get("eval_file_id")):
            raise Conflict(f"file {file.id} is used by {status} job {job_id}", param="file_id")
    file_id, stored = file.id, Path(file.storage_path)
    session.delete(file)
    after_commit(session, lambda: _delete_stored(file_id, stored, settings))
    return FileDeleted(id=file.id)


def _delete_stored(file_id: str, stored: Path, settings: Settings) -> None:
    try:
        resolved = stored.resolve()
        if resolved.is_relative_to(settings.uploads_dir.resolve()):
            resolved.unlink(missing_ok=True)
        else:
            log.warning("not deleting %s: outside the uploads folder", resolved)
    except OSError:
        log.exception("could not delete the stored bytes of %s", file_id)


def stored_path(file: File, settings: Settings) -> Path:
    """Where an upload's bytes are (confined to the uploads folder), or 404 if they are gone."""
    try:
        return stored_upload(file.id, file.storage_path, settings, "file_id")
    except Refused:
        raise NotFound(f"the bytes of file {file.id} are missing from storage",
                       param="file_id") from None
