"""Errors as OpenAI renders them, on the routes OpenAI's SDKs call: ``{"error": {"message",
"type", "param", "code"}}``, and 400 (not 422) for a request that does not validate, so the
SDK raises BadRequestError with the right ``param``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from core.infra.errors import FtuneError

# Paths only the OpenAI face serves; /v1/files is shared, and an upload that names a
# ``purpose`` (OpenAI's SDK always does) marks its request (api/services/files.py).
OPENAI_PATHS = ("/v1/fine_tuning/", "/v1/models", "/v1/evals", "/v1/chat/",
                "/v1/completions")
OPENAI_SCOPE_KEY = "ftune.openai"
TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
         403: "invalid_request_error", 404: "invalid_request_error",
         409: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 503: "server_error"}


def speaks_openai(request: Request) -> bool:
    path = request.url.path
    return bool(request.scope.get(OPENAI_SCOPE_KEY)) or path.startswith(OPENAI_PATHS) \
        or path == "/v1/fine_tuning"


def mark_openai(request: Request) -> None:
    request.scope[OPENAI_SCOPE_KEY] = True


def openai_status(status: int) -> int:
    return 400 if status == 422 else status


def openai_body(exc: FtuneError) -> dict[str, Any]:
    status = openai_status(exc.status_code)
    code = "invalid_api_key" if status == 401 else exc.code
    body: dict[str, Any] = {"message": exc.message, "type": TYPES.get(status, "server_error"),
                            "param": exc.param, "code": code}
    if exc.details:
        body["details"] = exc.details
    return {"error": body}


def openai_headers(exc: FtuneError) -> dict[str, str]:
    """OpenAI's SDKs retry a 409 by default; a state conflict here does not clear by itself
    (pausing a finished job), so say not to (the SDKs read ``x-should-retry``)."""
    return {"x-should-retry": "false"} if exc.status_code == 409 else {}
