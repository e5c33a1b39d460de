"""One log line per request: method, route template, status, duration and tenant. Never a
header (so never the Authorization header) and never the query string."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import route_template
from core.logging import log_context

log = logging.getLogger("ftune.api.request")

# Probes and scrapes: every few seconds, forever; only at DEBUG.
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestLogMiddleware:
    """Pure ASGI (streams pass through untouched). Opens the log context of the request, so
    the tenant bound at authentication (api/deps.py) is on every line the request writes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with log_context():
            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                path = scope.get("path", "")
                route = route_template(scope)
                level = logging.ERROR if status >= 500 else logging.INFO
                if path in QUIET_PATHS and status < 500:
                    level = logging.DEBUG
                method = scope.get("method", "")
                log.log(
                    level,
                    "%s %s %d",
                    method,
                    route if route != "unmatched" else path,
                    status,
                    extra={
                        "method": method,
                        "route": route,
                        "path": path,
                        "status": status,
                        "duration_ms": round((time.perf_counter() - start) * 1000, 2),
                    },
                )
