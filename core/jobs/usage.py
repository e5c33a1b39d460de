"""Usage and cost: what each attempt of a job used, summed per job and per tenant and day.

An attempt (a row of ``job_attempts``) opens when a worker claims the job and closes when the
move that ends it commits (core/jobs/state.py); the monitor adds the tokens the trainer reports.
GPU-seconds are processes x wall seconds of the attempt: every rank holds one GPU for the
whole attempt (model load and save included, as a cloud bills them); on a CPU worker they
are process-seconds. Tokens are non-padding input tokens and tokens with a loss, over all
ranks, as the trainer counted them in each attempt: steps an attempt redoes after a resume
count again, because they ran again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from core.db.models import Job, JobAttempt
from core.spec import DistributedSpec

# GET /v1/usage answers at most this many days at once.
MAX_USAGE_DAYS = 366


def spec_processes(spec: dict[str, Any]) -> int:
    """Trainer processes a (stored) spec asks for: 1 unless distributed."""
    return DistributedSpec.model_validate(spec.get("distributed") or {}).processes


def open_attempt(session: Session, job_id: str, *, attempt: int, worker_id: str,
                 started_at: datetime, processes: int) -> None:
    session.add(JobAttempt(job_id=job_id, attempt=attempt, worker_id=worker_id,
                           started_at=started_at, processes=processes, tokens=0, loss_tokens=0))
    session.flush()


def close_attempt(session: Session, job_id: str, *, ended_at: datetime) -> None:
    """The job's open attempt (there is at most one) ends now."""
    session.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job_id, JobAttempt.ended_at.is_(None))
        .values(ended_at=ended_at)
        .execution_options(synchronize_session=False)
    )


def cost(gpu_seconds: float, price_per_gpu_hour: float | None) -> float | None:
    if price_per_gpu_hour is None:
        return None
    return round(gpu_seconds / 3600 * price_per_gpu_hour, 6)


@dataclass
class Totals:
    tokens: int = 0
    loss_tokens: int = 0
    wall_seconds: float = 0.0
    gpu_seconds: float = 0.0
    attempts: int = 0
    jobs: set[str] = field(default_factory=set)

    def add(self, a: JobAttempt, now: datetime) -> None:
        end = a.ended_at or now
        seconds = max((end - a.started_at).total_seconds(), 0.0)
        self.tokens += int(a.tokens or 0)
        self.loss_tokens += int(a.loss_tokens or 0)
        self.wall_seconds += seconds
        self.gpu_seconds += seconds * a.processes
        self.attempts += 1
        self.jobs.add(a.job_id)

    def as_dict(self, price_per_gpu_hour: float | None, currency: str) -> dict[str, Any]:
        return {
            "trained_tokens": self.tokens,
            "loss_tokens": self.loss_tokens,
            "wall_seconds": round(self.wall_seconds, 3),
            "gpu_seconds": round(self.gpu_seconds, 3),
            "attempts": self.attempts,
            "cost": cost(self.gpu_seconds, price_per_gpu_hour),
            "currency": currency if price_per_gpu_hour is not None else None,
        }


def job_totals(attempts: Iterable[JobAttempt], now: datetime) -> Totals:
    """One job's usage; an attempt still running counts up to ``now``."""
    t = Totals()
    for a in attempts:
        t.add(a, now)
    return t


# Built once: every poll of a job reads its attempts, and building the statement per call
# cost more than running it.
_ATTEMPTS_OF = (select(JobAttempt)
                .where(JobAttempt.job_id.in_(bindparam("job_ids", expanding=True)))
                .order_by(JobAttempt.attempt))


def attempts_of(session: Session, job_ids: list[str]) -> dict[str, list[JobAttempt]]:
    out: dict[str, list[JobAttempt]] = {j: [] for j in job_ids}
    if not job_ids:
        return out
    rows = session.scalars(_ATTEMPTS_OF, {"job_ids": job_ids})
    for a in rows:
        out[a.job_id].append(a)
    return out


def by_day(attempts: Iterable[JobAttempt], first: date, last: date) -> list[tuple[date, Totals]]:
    """Ended attempts summed by the UTC day they ended, one entry per day from ``first`` to
    ``last`` inclusive (days with nothing are zeros, so a chart needs no gap filling)."""
    days = {first + timedelta(days=i): Totals() for i in range((last - first).days + 1)}
    for a in attempts:
        if a.ended_at is None:
            continue
        day = a.ended_at.astimezone(UTC).date()
        if day in days:
            days[day].add(a, a.ended_at)
    return sorted(days.items())


def tenant_attempts(session: Session, tenant_id: str, first: date, last: date) -> list[JobAttempt]:
    """The tenant's attempts that ended on the days ``first`` to ``last`` (UTC)."""
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    end = datetime(last.year, last.month, last.day, tzinfo=UTC) + timedelta(days=1)
    return list(
        session.scalars(
            select(JobAttempt)
            .join(Job, Job.id == JobAttempt.job_id)
            .where(Job.tenant_id == tenant_id, JobAttempt.ended_at >= start,
                   JobAttempt.ended_at < end)
        )
    )


def _attempt_seconds(session: Session) -> Any:
    """SQL: seconds from started_at to ended_at, in the session's dialect."""
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", JobAttempt.ended_at - JobAttempt.started_at)
    return (func.julianday(JobAttempt.ended_at) - func.julianday(JobAttempt.started_at)) * 86400.0


def ended_totals_by_tenant(session: Session) -> dict[str, Totals]:
    """Every ended attempt summed per tenant, in the database: Prometheus counters (they
    only grow, as attempts end)."""
    seconds = _attempt_seconds(session)
    rows = session.execute(
        select(
            Job.tenant_id,
            func.coalesce(func.sum(JobAttempt.tokens), 0),
            func.coalesce(func.sum(JobAttempt.loss_tokens), 0),
            func.coalesce(func.sum(seconds), 0.0),
            func.coalesce(func.sum(seconds * JobAttempt.processes), 0.0),
            func.count(JobAttempt.id),
        )
        .join(Job, Job.id == JobAttempt.job_id)
        .where(JobAttempt.ended_at.is_not(None))
        .group_by(Job.tenant_id)
    ).all()
    out: dict[str, Totals] = {}
    for tenant_id, tokens, loss_tokens, wall, gpu, attempts in rows:
        # Rounded to the millisecond: SQLite's julianday() arithmetic is off in the last bits.
        out[tenant_id] = Totals(tokens=int(tokens), loss_tokens=int(loss_tokens),
                                wall_seconds=round(float(wall), 3),
                                gpu_seconds=round(float(gpu), 3),
                                attempts=int(attempts))
    return out
