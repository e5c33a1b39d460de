"""GET /v1/jobs/{id}, what dashboards poll, answered before FastAPI's routing for a key the
key cache trusts (``ServePolledJobs``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import Reader, bearer_key, trusted_tenant
from api.routes.jobs import POLLED_JOB_PATH, read_job
from core.db.models import Tenant
from core.infra.logging import bind

log = logging.getLogger("ftune.api")

_POLLED_JOB_PREFIX = "/v1/jobs/"


class ServePolledJobs:
    """Answers GET /v1/jobs/{id} before FastAPI's routing and dependency solving, with the
    route's own ``read_job``, when the request's key is one the key cache trusts
    (``trusted_tenant``). Those were most of the CPU of a request answered from a kept
    body, and of the event loop's share of a read (~45 % on PostgreSQL, where the read's
    trip to a thread is what remains: docs/benchmarks.md). Every other request, and every
    one this does not answer (a key to verify, a malformed header, a job not found, a read
    that failed), goes on to the app, whose route answers and refuses as always (a failed
    read is tried once more there).

    Pure ASGI, inside ObserveRequests: its answers are logged and counted under the route's
    template, with the tenant and job bound as the route binds them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._route: BaseRoute | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = None
        asked = self._asked(scope) if scope["type"] == "http" else None
        if asked is not None:
            tenant, job_id = asked
            try:
                response = await read_job(Reader(Request(scope)), tenant, job_id)
            except Exception:  # the route reads again and answers as it answers errors
                log.debug("GET job %s: left to the route after a failed read", job_id,
                          exc_info=True)  # fmt: skip
        if response is None:
            await self.app(scope, receive, send)
            return
        scope["route"] = self._route or self._find_route(scope["app"])
        await response(scope, receive, send)

    def _asked(self, scope: Scope) -> tuple[Tenant, str] | None:
        """(tenant, job id) of a GET /v1/jobs/{id} with a trusted key, else None."""
        path: str = scope["path"]
        if scope["method"] != "GET" or not path.startswith(_POLLED_JOB_PREFIX):
            return None
        job_id = path[len(_POLLED_JOB_PREFIX):]
        if not job_id or "/" in job_id:
            return None
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        key = bearer_key(authorization.decode("latin-1")) if authorization else None
        tenant = trusted_tenant(scope["app"].state, key) if key else None
        if tenant is None:
            return None
        bind(tenant_id=tenant.id)
        return tenant, job_id

    def _find_route(self, app: FastAPI) -> BaseRoute:
        self._route = next(r for r in app.routes
                           if getattr(r, "path", None) == POLLED_JOB_PATH)
        return self._route
