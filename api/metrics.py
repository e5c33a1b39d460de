"""Prometheus metrics: HTTP requests by route template, jobs by status, queue age."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.db.models import Job, JobStatus, utcnow

log = logging.getLogger("ftune.api")

MakerGetter = Callable[[], "sessionmaker[Session] | None"]


class JobsCollector(Collector):
    """Read at scrape time from the DB, so every API replica reports the same numbers."""

    def __init__(self, get_sessionmaker: MakerGetter) -> None:
        self._get_sessionmaker = get_sessionmaker

    def collect(self) -> Iterator[GaugeMetricFamily]:
        maker = self._get_sessionmaker()
        if maker is None:
            return
        try:
            with maker() as session:
                by_status = select(Job.status, func.count(Job.id)).group_by(Job.status)
                counts = dict(session.execute(by_status).all())
                oldest = session.scalar(
                    select(func.min(Job.queued_at)).where(Job.status == JobStatus.queued)
                )
        except Exception:
            log.exception("metrics: could not read jobs from the database")
            return
        jobs = GaugeMetricFamily("ftune_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        age = 0.0
        if oldest is not None:
            if oldest.tzinfo is None:
                oldest = oldest.replace(tzinfo=UTC)
            age = max((utcnow() - oldest).total_seconds(), 0.0)
        yield GaugeMetricFamily(
            "ftune_queue_oldest_age_seconds",
            "Seconds the oldest queued job has waited (0 when none is queued).",
            value=age,
        )


class Metrics:
    def __init__(self, get_sessionmaker: MakerGetter) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.registry.register(JobsCollector(get_sessionmaker))
        self.requests = Counter(
            "ftune_http_requests",
            "HTTP requests by method, route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ftune_http_request_duration_seconds",
            "HTTP request duration by method and route template.",
            ["method", "route"],
            registry=self.registry,
        )


class MetricsMiddleware:
    """Pure ASGI (streams pass through untouched); labels by route template, not raw path."""

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

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            template = getattr(route, "path_format", None) or getattr(route, "path", None)
            label = template or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.labels(method, label, str(status)).inc()
            self.metrics.latency.labels(method, label).observe(time.perf_counter() - start)
