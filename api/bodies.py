"""Request bodies read by hand: bounded in size while they stream in, and strict JSON (the
job routes of both faces read their body whatever the content type)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from core.infra.errors import InvalidRequest, PayloadTooLarge

MAX_SPEC_BYTES = 1 << 20


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is larger than {limit} bytes", param="body")
        chunks.append(chunk)
    return b"".join(chunks)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON: no NaN or Infinity (JSON has none; PostgreSQL refuses to store them)."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(
            "the body must be a JSON object (a JobSpec) in UTF-8", param="body"
        ) from None
