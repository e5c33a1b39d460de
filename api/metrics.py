"""Prometheus metrics: HTTP requests by route template (counted by api/middleware/observe.py); from the
database at scrape time, jobs by status, the queue, recent run times, worker heartbeats and
training throughput; webhook deliveries by status. Each read costs what is live (the queue,
the jobs held, the last hour, the workers of the last day) or a few kept rows, never the
history (docs/benchmarks.md, growth)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Scope

from core.db.models import (
    DeliveryStatus,
    GpuAllocation,
    Job,
    JobStatus,
    WebhookDelivery,
    Worker,
    utcnow,
)
from core.jobs import state as jobstate
from core.jobs.usage import Totals, ended_totals_by_tenant

T = TypeVar("T")

log = logging.getLogger("ftune.api")

MakerGetter = Callable[[], "sessionmaker[Session] | None"]


# Run times of finished jobs: from a minute to a day.
DURATION_BUCKETS = (60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)
DURATION_WINDOW = timedelta(hours=1)
# The fleet's gauges list the workers that heart-beat this recently.
WORKERS_WINDOW = timedelta(days=1)


@dataclass
class JobsSnapshot:
    counts: dict[str, int]
    oldest_queued: datetime | None
    finished: list[tuple[str, datetime, datetime]]  # (status, started_at, finished_at)
    heartbeats: list[tuple[str | None, datetime]]  # (worker_id, latest heartbeat)
    tokens_per_second: list[tuple[str, float]]  # (job id, tokens/s) of running jobs
    usage: dict[str, Totals]  # ended attempts, by tenant id


def read_snapshot(session: Session, now: datetime) -> JobsSnapshot:
    """Small queries whose cost does not grow with the history: the kept counts by status
    (core/jobs/state.py) and usage totals (core/jobs/usage.py), one index probe for the
    oldest queued job, and index ranges of the jobs held now or finished in the last hour."""
    counts = jobstate.counts_by_status(session)
    # min over ix_jobs_status_queued_at: the first entry after (queued, NULL), not a read
    # of every queued job.
    oldest = session.scalar(select(func.min(Job.queued_at)).where(Job.status == JobStatus.queued))
    # By finish time alone, the status checked here: a status condition in the query led
    # SQLite (no statistics) to scan every finished job by status instead of the last hour
    # by ix_jobs_finished_at.
    finished = [r for r in session.execute(
        select(Job.status, Job.started_at, Job.finished_at).where(
            Job.finished_at >= now - DURATION_WINDOW,
            Job.started_at.is_not(None),
        )
    ).all() if r.status in jobstate.FINISHED]
    last_seen = func.max(func.coalesce(Job.heartbeat_at, Job.started_at))
    heartbeats = session.execute(
        select(Job.worker_id, last_seen).where(Job.status.in_(jobstate.HELD)).group_by(Job.worker_id)
    ).all()
    tps = session.execute(
        select(Job.id, Job.tokens_per_second).where(
            Job.status == JobStatus.running, Job.tokens_per_second.is_not(None)
        )
    ).all()
    return JobsSnapshot(
        counts=counts,
        oldest_queued=oldest,
        finished=[tuple(r) for r in finished],  # type: ignore[misc]
        heartbeats=[(w, t) for w, t in heartbeats if t is not None],
        tokens_per_second=[tuple(r) for r in tps],  # type: ignore[misc]
        usage=ended_totals_by_tenant(session),
    )


def _seconds(later: datetime, earlier: datetime) -> float:
    if later.tzinfo is None:
        later = later.replace(tzinfo=UTC)
    if earlier.tzinfo is None:
        earlier = earlier.replace(tzinfo=UTC)
    return max((later - earlier).total_seconds(), 0.0)


class DatabaseCollector(Collector, Generic[T]):
    """Families read from the database at scrape time, so every API replica reports the same
    numbers. A failed read is logged and the scrape goes on without these families (the
    process's own metrics still come)."""

    what = ""  # what is read, for the log line

    def __init__(self, get_sessionmaker: MakerGetter) -> None:
        self._get_sessionmaker = get_sessionmaker

    def collect(self) -> Iterator[Metric]:
        maker = self._get_sessionmaker()
        if maker is None:
            return
        now = utcnow()
        try:
            with maker() as session:
                data = self.read(session, now)
        except Exception:
            log.exception("metrics: could not read %s from the database", self.what)
            return
        yield from self.families(data, now)

    def read(self, session: Session, now: datetime) -> T:
        raise NotImplementedError

    def families(self, data: T, now: datetime) -> Iterator[Metric]:
        raise NotImplementedError


class JobsCollector(DatabaseCollector[JobsSnapshot]):
    what = "jobs"

    def read(self, session: Session, now: datetime) -> JobsSnapshot:
        return read_snapshot(session, now)

    def families(self, snap: JobsSnapshot, now: datetime) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("ftune_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], snap.counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily(
            "ftune_queue_depth",
            "Jobs queued and not yet claimed by a worker.",
            value=snap.counts.get(JobStatus.queued.value, 0),
        )
        age = _seconds(now, snap.oldest_queued) if snap.oldest_queued is not None else 0.0
        yield GaugeMetricFamily(
            "ftune_queue_oldest_age_seconds",
            "Seconds the oldest queued job has waited (0 when none is queued).",
            value=age,
        )
        yield self._durations(snap)
        workers = GaugeMetricFamily(
            "ftune_worker_heartbeat_age_seconds",
            "Seconds since the worker last heart-beat one of the jobs it holds (running, "
            "cancelling or pausing); the reconciler gives a job up past "
            "FTUNE_HEARTBEAT_TIMEOUT_SECONDS.",
            labels=["worker"],
        )
        for worker, seen in sorted(snap.heartbeats, key=lambda r: r[0] or ""):
            workers.add_metric([worker or "unknown"], _seconds(now, seen))
        yield workers
        tps = GaugeMetricFamily(
            "ftune_job_tokens_per_second",
            "Training throughput of each running job, as last reported by its trainer.",
            labels=["job_id"],
        )
        for job_id, value in sorted(snap.tokens_per_second):
            tps.add_metric([job_id], value)
        yield tps
        yield from self._usage(snap)

    @staticmethod
    def _usage(snap: JobsSnapshot) -> Iterator[Metric]:
        """Usage of ended attempts by tenant (core/jobs/usage.py); counters: they only grow."""
        families = (
            ("ftune_trained_tokens", "Non-padding tokens trained.", lambda t: t.tokens),
            ("ftune_loss_tokens", "Label tokens trained with a loss.", lambda t: t.loss_tokens),
            ("ftune_gpu_seconds", "Processes x seconds of ended job attempts.", lambda t: t.gpu_seconds),
            ("ftune_job_attempts", "Job attempts that ended.", lambda t: t.attempts),
        )
        for name, doc, value in families:
            family = CounterMetricFamily(name, doc, labels=["tenant_id"])
            for tenant_id, totals in sorted(snap.usage.items()):
                family.add_metric([tenant_id], float(value(totals)))
            yield family

    @staticmethod
    def _durations(snap: JobsSnapshot) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "ftune_job_duration_seconds",
            "Run time (started to finished) of the jobs that finished in the last hour, by "
            "final status. A sliding window read from the database: use it as it is "
            "(histogram_quantile over the buckets), not through rate().",
            labels=["status"],
        )
        by_status: dict[str, list[float]] = {
            s.value: [] for s in JobStatus if s in jobstate.FINISHED
        }
        for status, started, finished in snap.finished:
            by_status.setdefault(status, []).append(_seconds(finished, started))
        for status, values in sorted(by_status.items()):
            buckets = [(str(le), float(sum(v <= le for v in values))) for le in DURATION_BUCKETS]
            buckets.append(("+Inf", float(len(values))))
            family.add_metric([status], buckets, sum_value=sum(values))
        return family


class WebhooksCollector(DatabaseCollector[dict[str, int]]):
    """Webhook deliveries by status, from the database: the senders run in the workers (or
    `ftune webhooks`), which serve no /metrics of their own."""

    what = "webhook deliveries"

    def read(self, session: Session, now: datetime) -> dict[str, int]:
        return dict(session.execute(  # type: ignore[arg-type]
            select(WebhookDelivery.status, func.count(WebhookDelivery.id))
            .group_by(WebhookDelivery.status)).all())

    def families(self, counts: dict[str, int], now: datetime) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "ftune_webhook_deliveries",
            "Webhook deliveries by status: pending (being retried), delivered, failed (the "
            "retry window ran out). Deleting an endpoint removes its deliveries.",
            labels=["status"])
        for status in DeliveryStatus:
            family.add_metric([status.value], counts.get(status.value, 0))
        yield family


@dataclass
class FleetSnapshot:
    workers: list[Any]  # (id, state, gpus) rows
    held: dict[str, int]  # worker -> GPUs allocated
    waits: list[Any]  # (priority, queued count, oldest created_at) rows


class FleetCollector(DatabaseCollector[FleetSnapshot]):
    """Per-worker GPUs and allocations, and the queue's wait by priority, at scrape time."""

    what = "the fleet"

    def read(self, session: Session, now: datetime) -> FleetSnapshot:
        return FleetSnapshot(
            # A worker id is per process (host:pid) unless set: every restart leaves a row,
            # so the workers seen lately, an index range, not every one there ever was.
            workers=list(session.execute(select(Worker.id, Worker.state, Worker.gpus)
                                         .where(Worker.heartbeat_at >= now - WORKERS_WINDOW))
                         .all()),
            held=dict(session.execute(  # type: ignore[arg-type]
                select(GpuAllocation.worker_id, func.count(GpuAllocation.gpu_index))
                .where(GpuAllocation.gpu_index >= 0)
                .group_by(GpuAllocation.worker_id)).all()),
            waits=list(session.execute(
                select(Job.priority, func.count(Job.id), func.min(Job.created_at))
                .where(Job.status == JobStatus.queued)
                .group_by(Job.priority)).all()),
        )

    def families(self, snap: FleetSnapshot, now: datetime) -> Iterator[Metric]:
        workers, held, waits = snap.workers, snap.held, snap.waits
        gpus = GaugeMetricFamily(
            "ftune_worker_gpus", "GPUs a registered worker has (the workers that heart-beat "
            "in the last day: a worker lost or stopped before is no longer listed).",
            labels=["worker", "state"]
        )
        allocated = GaugeMetricFamily(
            "ftune_worker_gpus_allocated",
            "GPUs of the worker held by running jobs.",
            labels=["worker"],
        )
        for wid, state, listed in sorted(workers):
            gpus.add_metric([wid, state], len(listed or []))
            allocated.add_metric([wid], held.get(wid, 0))
        yield gpus
        yield allocated
        depth = GaugeMetricFamily(
            "ftune_queued_jobs", "Queued jobs by priority.", labels=["priority"]
        )
        wait = GaugeMetricFamily(
            "ftune_queue_wait_seconds",
            "Longest wait (since submission) of a queued job, by priority.",
            labels=["priority"],
        )
        for priority, count, oldest in sorted(waits):
            depth.add_metric([str(priority)], count)
            wait.add_metric([str(priority)], _seconds(now, oldest))
        yield depth
        yield wait


class Metrics:
    def __init__(self, get_sessionmaker: MakerGetter) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.registry.register(JobsCollector(get_sessionmaker))
        self.registry.register(WebhooksCollector(get_sessionmaker))
        self.registry.register(FleetCollector(get_sessionmaker))
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
        # Inference (api/openai/inference.py), counted by this API process as answers end.
        self.inference_requests = Counter(
            "ftune_inference_requests", "Inference requests answered, by tenant and model.",
            ["tenant_id", "model"], registry=self.registry)
        self.inference_tokens = Counter(
            "ftune_inference_tokens", "Tokens of inference requests, by tenant, model and "
            "kind (prompt, completion), as the engine counted them.",
            ["tenant_id", "model", "kind"], registry=self.registry)


def route_template(scope: Scope) -> str:
    """The matched route's template (never the raw path: ids would make endless labels)."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if template:
        return str(template)
    if scope.get("path", "").startswith("/ui/static/"):
        return "/ui/static/{path}"
    return "unmatched"
