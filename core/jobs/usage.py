"""Usage and cost: what each attempt of a job used, summed per job and per tenant and day.

An attempt (a row of ``job_attempts``) opens when a worker claims the job and closes when the
move that ends it commits (core/jobs/state.py); the monitor adds the tokens the trainer reports.
GPU-seconds are processes x wall seconds of the attempt: every rank holds one GPU for the
whole attempt (model load and save included, as a cloud bills them); on a CPU worker they
are process-seconds. Tokens are non-padding input tokens and tokens with a loss, over all
ranks, as the trainer counted them in each attempt: steps an attempt redoes after a resume
count again, because they ran again.

Per tenant and UTC day, the ended attempts are also kept summed in ``usage_days``, updated in
the transaction that ends an attempt (``close_attempt``) and in the one that adds tokens an
ended attempt reported late (``attempt_reported``), and per tenant over all time in
``usage_totals`` by the same transactions: GET /v1/usage reads the days asked for and
/metrics one row a tenant, not the history. ``recount_days`` sums the attempts
themselves, the same numbers the long way (tests compare them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core.db.models import Job, JobAttempt, UsageDay, UsageTotal
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
    """The job's open attempt (there is at most one) ends now, and counts in its day."""
    row = session.execute(
        update(JobAttempt)
        .where(JobAttempt.job_id == job_id, JobAttempt.ended_at.is_(None))
        .values(ended_at=ended_at)
        .returning(JobAttempt.id, JobAttempt.started_at, JobAttempt.processes,
                   JobAttempt.tokens, JobAttempt.loss_tokens)
        .execution_options(synchronize_session=False)
    ).first()
    if row is None:
        return
    day = ended_at.astimezone(UTC).date()
    start, end = _day_bounds(day)
    # The job counts once a day: not again if another of its attempts ended that day.
    earlier = session.scalar(
        select(func.count(JobAttempt.id)).where(
            JobAttempt.job_id == job_id, JobAttempt.id != row.id,
            JobAttempt.ended_at >= start, JobAttempt.ended_at < end))
    seconds = _seconds(row.started_at, ended_at)
    _add_to_day(session, _tenant_of(session, job_id), day, attempts=1, jobs=int(not earlier),
                tokens=int(row.tokens or 0), loss_tokens=int(row.loss_tokens or 0),
                wall_seconds=seconds, gpu_seconds=seconds * row.processes)


def attempt_reported(session: Session, job_id: str, attempt: int,
                     values: dict[str, Any]) -> None:
    """Call before writing ``values`` (tokens, loss_tokens, processes) to an attempt: if it
    has ended already (its last events ingested after the move that ended it), its day
    takes the difference."""
    a = session.execute(
        select(JobAttempt.started_at, JobAttempt.ended_at, JobAttempt.processes,
               JobAttempt.tokens, JobAttempt.loss_tokens)
        .where(JobAttempt.job_id == job_id, JobAttempt.attempt == attempt)
    ).first()
    if a is None or a.ended_at is None:
        return
    tokens = int(values.get("tokens", a.tokens) or 0) - int(a.tokens or 0)
    loss_tokens = int(values.get("loss_tokens", a.loss_tokens) or 0) - int(a.loss_tokens or 0)
    processes = int(values.get("processes", a.processes)) - a.processes
    if not (tokens or loss_tokens or processes):
        return
    _add_to_day(session, _tenant_of(session, job_id), a.ended_at.astimezone(UTC).date(),
                tokens=tokens, loss_tokens=loss_tokens,
                gpu_seconds=_seconds(a.started_at, a.ended_at) * processes)


def _seconds(started_at: datetime, ended_at: datetime) -> float:
    return max((ended_at - started_at).total_seconds(), 0.0)


def _day_bounds(day: date) -> tuple[datetime, datetime]:
    start = datetime(day.year, day.month, day.day, tzinfo=UTC)
    return start, start + timedelta(days=1)


def _tenant_of(session: Session, job_id: str) -> str:
    return str(session.scalar(select(Job.tenant_id).where(Job.id == job_id)))


_DAY_SUMS = ("attempts", "jobs", "tokens", "loss_tokens", "wall_seconds", "gpu_seconds")
_TOTAL_SUMS = tuple(k for k in _DAY_SUMS if k != "jobs")  # jobs of a day do not add up


def _add_to_day(session: Session, tenant_id: str, day: date, **add: float) -> None:
    """usage_days[tenant, day] += ``add``, created at zero if missing (one upsert: two
    attempts ending at once on PostgreSQL queue on the row, none is lost)."""
    values = {k: add.get(k, 0) for k in _DAY_SUMS}
    dialect = session.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(UsageDay).values(tenant_id=tenant_id, day=day, **values)
    table = UsageDay.__table__.c
    session.execute(stmt.on_conflict_do_update(
        index_elements=["tenant_id", "day"],
        set_={k: table[k] + stmt.excluded[k] for k in _DAY_SUMS}))
    # The tenant's all-time row: locked by the transactions that lock its day row already
    # (the same tenant, now), so it queues no one who would not queue anyway.
    totals = {k: add.get(k, 0) for k in _TOTAL_SUMS}
    stmt = insert(UsageTotal).values(tenant_id=tenant_id, **totals)
    table = UsageTotal.__table__.c
    session.execute(stmt.on_conflict_do_update(
        index_elements=["tenant_id"], set_={k: table[k] + stmt.excluded[k] for k in _TOTAL_SUMS}))


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
    job_count: int = 0  # len(jobs), or the number alone where ids are not kept (usage_days)

    def add(self, a: JobAttempt, now: datetime) -> None:
        end = a.ended_at or now
        seconds = max((end - a.started_at).total_seconds(), 0.0)
        self.tokens += int(a.tokens or 0)
        self.loss_tokens += int(a.loss_tokens or 0)
        self.wall_seconds += seconds
        self.gpu_seconds += seconds * a.processes
        self.attempts += 1
        if a.job_id not in self.jobs:
            self.jobs.add(a.job_id)
            self.job_count += 1

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


def tenant_days(session: Session, tenant_id: str, first: date,
                last: date) -> list[tuple[date, Totals]]:
    """The tenant's kept day sums, one entry per day from ``first`` to ``last`` inclusive
    (days with nothing are zeros); ``Totals.jobs`` holds the day's job count, not ids."""
    days = {first + timedelta(days=i): Totals() for i in range((last - first).days + 1)}
    rows = session.scalars(select(UsageDay).where(
        UsageDay.tenant_id == tenant_id, UsageDay.day >= first, UsageDay.day <= last))
    for r in rows:
        days[r.day] = Totals(tokens=int(r.tokens), loss_tokens=int(r.loss_tokens),
                             wall_seconds=float(r.wall_seconds),
                             gpu_seconds=float(r.gpu_seconds), attempts=int(r.attempts),
                             job_count=int(r.jobs))
    return sorted(days.items())


def recount_days(session: Session, tenant_id: str, first: date,
                 last: date) -> list[tuple[date, Totals]]:
    """What ``tenant_days`` keeps, summed from the attempts themselves (reads every attempt
    of the range: for checks, not for requests)."""
    return by_day(tenant_attempts(session, tenant_id, first, last), first, last)


def tenant_attempts(session: Session, tenant_id: str, first: date, last: date) -> list[JobAttempt]:
    """The tenant's attempts that ended on the days ``first`` to ``last`` (UTC)."""
    start, _ = _day_bounds(first)
    _, end = _day_bounds(last)
    return list(
        session.scalars(
            select(JobAttempt)
            .join(Job, Job.id == JobAttempt.job_id)
            .where(Job.tenant_id == tenant_id, JobAttempt.ended_at >= start,
                   JobAttempt.ended_at < end)
        )
    )


def ended_totals_by_tenant(session: Session) -> dict[str, Totals]:
    """Every ended attempt summed per tenant, from the kept totals (one row a tenant):
    Prometheus counters (they only grow, as attempts end). Rounded to the millisecond, as
    the report."""
    t = UsageTotal
    rows = session.execute(select(t.tenant_id, t.tokens, t.loss_tokens, t.wall_seconds,
                                  t.gpu_seconds, t.attempts)).all()
    return {tenant_id: _rounded(tokens, loss_tokens, wall, gpu, attempts)
            for tenant_id, tokens, loss_tokens, wall, gpu, attempts in rows}


def recount_totals_by_tenant(session: Session) -> dict[str, Totals]:
    """What ``ended_totals_by_tenant`` keeps, summed from every day row of every tenant
    (reads the whole history of days: for checks, not for scrapes)."""
    d = UsageDay
    rows = session.execute(
        select(d.tenant_id, func.sum(d.tokens), func.sum(d.loss_tokens),
               func.sum(d.wall_seconds), func.sum(d.gpu_seconds), func.sum(d.attempts))
        .group_by(d.tenant_id)
    ).all()
    return {tenant_id: _rounded(tokens, loss_tokens, wall, gpu, attempts)
            for tenant_id, tokens, loss_tokens, wall, gpu, attempts in rows}


def _rounded(tokens: Any, loss_tokens: Any, wall: Any, gpu: Any, attempts: Any) -> Totals:
    return Totals(tokens=int(tokens or 0), loss_tokens=int(loss_tokens or 0),
                  wall_seconds=round(float(wall or 0), 3), gpu_seconds=round(float(gpu or 0), 3),
                  attempts=int(attempts or 0))
