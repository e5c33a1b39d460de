"""Each request observed once, when it ends: one log line (method, route template, status,
duration, tenant; never a header, so never the Authorization header, and never the query
string) and the Prometheus request counter and latency histogram (api/metrics.py)."""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.metrics import Metrics, route_template
from core.infra.logging import log_context

log = logging.getLogger("ftune.api.request")

# Probes and scrapes: every few seconds, forever; only at DEBUG.
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class ObserveRequests:
    """Pure ASGI (streams pass through untouched). Opens the log context of the request, so
    the tenant bound at authentication (api/deps.py) is on every line the request writes.
    One middleware for the line and the metrics: each wrapper around ``send`` costs every
    request a coroutine per message."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

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
                seconds = time.perf_counter() - start
                path = scope.get("path", "")
                method = scope.get("method", "")
                route = route_template(scope)
                self.metrics.requests.labels(method, route, str(status)).inc()
                self.metrics.latency.labels(method, route).observe(seconds)
                level = logging.ERROR if status >= 500 else logging.INFO
                if path in QUIET_PATHS and status < 500:
                    level = logging.DEBUG
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
                        "duration_ms": round(seconds * 1000, 2),
                    },
                )
