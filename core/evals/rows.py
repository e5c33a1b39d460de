"""A run's rows: {"item": {...}, "sample"?: {...}}, numbered from 0 (OpenAI's
datasource_item_id), from the run's file_content or from an item file (purpose evals), and
the messages a completions run sends for one item."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.data.reading import BadRow, DataFileError, iter_rows
from core.evals.spec import (
    CompletionsDataSource,
    FileContentSource,
    ItemReferenceInput,
    Source,
)
from core.spec.grader_template import render

Row = dict[str, Any]


def content_rows(source: FileContentSource) -> list[tuple[int, Row]]:
    return [(n, r.model_dump(exclude_none=True)) for n, r in enumerate(source.content)]


def file_rows(path: Path, max_decompressed_bytes: int | None = None) -> Iterator[tuple[int, Row]]:
    """The rows of a stored item file; a line that is not an object is a DataFileError
    naming its row (1-based, as the upload check said it)."""
    for n, rec in enumerate(iter_rows(path, max_decompressed_bytes=max_decompressed_bytes,
                                      tolerant=True)):
        if isinstance(rec, BadRow):
            raise DataFileError(rec.message, row=n + 1)
        yield n, rec


def upload_problems(path: Path, max_decompressed_bytes: int | None,
                    limit: int = 20) -> list[tuple[int, str]]:
    """An item file's rows as an upload with purpose evals checks them: each a JSON object
    with an "item" object and, if any, a "sample" object. (row number from 1, message)."""
    out: list[tuple[int, str]] = []
    for n, rec in enumerate(iter_rows(path, max_decompressed_bytes=max_decompressed_bytes,
                                      tolerant=True), start=1):
        if isinstance(rec, BadRow):
            out.append((n, rec.message))
        elif not isinstance(rec.get("item"), dict):
            out.append((n, ('needs an "item" object: rows are {"item": {...}} (and a "sample" '
                        "object for runs that grade given answers)")))
        elif "sample" in rec and not isinstance(rec["sample"], dict):
            out.append((n, '"sample" must be an object, e.g. {"output_text": "..."}'))
        elif extra := sorted(set(rec) - {"item", "sample"}):
            out.append((n, f"unknown keys {extra}: a row holds only item and sample"))
        if len(out) >= limit:
            break
    return out


def source_is_file(source: Source) -> bool:
    return not isinstance(source, FileContentSource)


def messages_for(ds: CompletionsDataSource, item: dict[str, Any]) -> list[dict[str, str]]:
    """The chat messages sent for ``item``: the template rendered over it, or the messages
    the item holds at item_reference. Raises TemplateError (the item's error) when a field
    is missing."""
    im = ds.input_messages
    if isinstance(im, ItemReferenceInput):
        from core.spec.grader_template import TemplateError

        value: Any = item
        for part in im.item_reference.split(".")[1:]:
            if not isinstance(value, dict) or part not in value:
                raise TemplateError(f"{im.item_reference}: no field {part!r}")
            value = value[part]
        if not isinstance(value, list):
            raise TemplateError(f"{im.item_reference}: not a list of messages")
        return [{"role": str(m.get("role")), "content": str(m.get("content"))}
                for m in value if isinstance(m, dict)]
    sample: dict[str, Any] = {}
    return [{"role": m.role, "content": render(m.content, sample, item)} for m in im.template]
