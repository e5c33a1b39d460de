"""One place that turns exceptions into the API's error body ``{"error": {...}}``."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.openai.errors import openai_body, openai_headers, openai_status, speaks_openai
from api.schemas import ErrorBody
from core.infra.errors import FtuneError, InvalidRequest, RateLimited
from core.spec import SpecError

log = logging.getLogger("ftune.api")

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


_DESCRIPTIONS = {
    400: "The body could not be parsed (not JSON).",
    401: "Missing, malformed, unknown or revoked API key.",
    403: "The API key's role does not allow it (an admin key is needed).",
    404: "No such object for this tenant.",
    409: "The object's state does not allow it.",
    413: "The upload is larger than the server's limit.",
    422: "Invalid request: every problem is listed in `details`.",
    429: "Too many requests; `Retry-After` says when to come back.",
    503: "Not ready: the body names what is unavailable.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` for the error statuses a route can answer, all ``ErrorBody``."""
    return {s: {"model": ErrorBody, "description": _DESCRIPTIONS[s]} for s in statuses}


class RetryLater(RateLimited):
    """429 that tells the client when to come back."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(max(1, retry_after))}


def spec_error_to_ftune(exc: SpecError) -> InvalidRequest:
    details = [p.to_dict() for p in exc.problems]
    n = len(details)
    message = f"the job spec has {n} problem{'s' if n != 1 else ''}"
    if n == 1:
        message += f": {details[0]['param']}: {details[0]['message']}"
    return InvalidRequest(
        message,
        code="invalid_spec",
        param=details[0]["param"] if n == 1 else None,
        details=details,
    )


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or str(loc[0] if loc else "body")


def render_error(exc: FtuneError, request: Request) -> JSONResponse:
    """The error's response, in OpenAI's shape on its paths: what the app's handler for
    FtuneError answers, for code that answers before the app (api/middleware/)."""
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    if speaks_openai(request):
        return JSONResponse(openai_body(exc), status_code=openai_status(exc.status_code),
                            headers={**headers, **openai_headers(exc)} or None)
    return JSONResponse(exc.to_dict(), status_code=exc.status_code, headers=headers or None)


async def _ftune_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FtuneError)
    return render_error(exc, request)


async def _spec_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SpecError)
    return render_error(spec_error_to_ftune(exc), request)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [
        {"param": _loc_to_param(tuple(e.get("loc", ()))), "message": str(e.get("msg", ""))}
        for e in exc.errors()
    ]
    n = len(details)
    message = f"the request has {n} invalid parameter{'s' if n != 1 else ''}"
    if n == 1:
        message = f"{details[0]['param']}: {details[0]['message']}"
    err = InvalidRequest(message, param=details[0]["param"] if n == 1 else None, details=details)
    return render_error(err, request)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err = FtuneError(str(exc.detail), code=_HTTP_CODES.get(exc.status_code, "http_error"))
    err.status_code = exc.status_code
    response = render_error(err, request)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    body = {"error": {"code": "internal", "message": "internal server error", "param": None}}
    return JSONResponse(body, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(FtuneError, _ftune_error)
    app.add_exception_handler(SpecError, _spec_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
