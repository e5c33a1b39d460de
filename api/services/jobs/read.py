"""The read model: job objects as the API shows them, pages of jobs, events and checkpoints,
and the queue's answer for a queued job."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import cast

from pydantic import ValidationError
from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from api.schemas import (
    CheckpointObject,
    EventObject,
    JobError,
    JobObject,
    JobUsage,
    Metrics,
    Page,
    Progress,
    QueueInfo,
    TrackingLinks,
)
from api.services import queue
from api.services.pagination import page_after
from api.services.phase import job_phase
from core.db.models import (
    Checkpoint,
    Job,
    JobAttempt,
    JobEvent,
    JobStatus,
    Tenant,
    utcnow,
)
from core.db.session import DriverSelect
from core.evals.job_results import JobEvaluation, artifact_kept
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.jobs import usage
from core.run.jobdir import MODEL_DIR

log = logging.getLogger("ftune.api")


def job_object(
    job: Job,
    checkpoints_count: int,
    now: datetime | None = None,
    attempts: list[JobAttempt] | None = None,
    settings: Settings | None = None,
    queue: QueueInfo | None = None,
) -> JobObject:
    now = now or utcnow()
    price = settings.price_per_gpu_hour if settings is not None else None
    currency = settings.price_currency if settings is not None else ""
    totals = usage.job_totals(attempts or [], now).as_dict(price, currency)
    percent = eta = None
    if job.total_steps:
        percent = round(min(job.step / job.total_steps, 1.0) * 100, 2)
        if (
            job.status in (JobStatus.running, JobStatus.cancelling)
            and job.training_started_at is not None
            and 0 < job.step < job.total_steps
        ):
            elapsed = (now - job.training_started_at).total_seconds()
            eta = round(max(elapsed, 0.0) / job.step * (job.total_steps - job.step), 1)
    error = None
    if job.error_code:
        error = JobError(code=job.error_code, message=job.error_message or "")
    done = artifact_kept(job)
    full_model = done and Path(job.adapter_path or "").name == MODEL_DIR
    return JobObject(
        id=job.id,
        name=job.name,
        status=job.status,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        spec=job.resolved_spec or job.spec,
        data=job.data_receipt,
        request=job.request if job.request is not None else job.spec,
        run=job.run_info,
        usage=JobUsage(**totals, epochs=job.epoch),
        progress=Progress(
            step=job.step,
            total_steps=job.total_steps,
            epoch=job.epoch,
            percent=percent,
            eta_seconds=eta,
        ),
        phase=job_phase(job),
        metrics=Metrics(
            train_loss=job.train_loss,
            eval_loss=job.eval_loss,
            learning_rate=job.learning_rate,
            tokens_per_second=job.tokens_per_second,
            peak_memory_mb=job.peak_memory_mb,
            preference=job.preference_metrics,
        ),
        checkpoints_count=checkpoints_count,
        adapter_available=done and not full_model,
        model_available=full_model,
        attempt=job.attempt,
        pauses=job.pauses or 0,
        error=error,
        tracking=tracking_links(job),
        priority=job.priority,
        queue=queue if queue is not None else slurm_wait(job),
        evaluation=JobEvaluation.model_validate(job.evaluation) if job.evaluation else None,
    )


def slurm_wait(job: Job) -> QueueInfo | None:
    """jobs.waiting_for (written by worker/slurm/run.py) in the job's one waiting field."""
    if not job.waiting_for:
        return None
    return QueueInfo(position=None, waiting_for="slurm", message=job.waiting_for)


def tracking_links(job: Job) -> TrackingLinks | None:
    """jobs.tracking (the trainer's "tracking" event) as links; None before it came."""
    runs = job.tracking
    if not runs:
        return None
    try:
        return TrackingLinks(
            tensorboard=f"/v1/jobs/{job.id}/tensorboard" if "tensorboard" in runs else None,
            mlflow=runs.get("mlflow"),
            wandb=runs.get("wandb"),
        )
    except ValidationError:  # written by the trainer: show nothing rather than fail the read
        log.warning("job %s: unreadable tracking links %r", job.id, runs)
        return None


def job_objects(
    session: Session, jobs: list[Job], settings: Settings | None = None
) -> list[JobObject]:
    counts: dict[str, int] = {}
    if jobs:
        counts = dict(
            session.execute(  # type: ignore[arg-type]
                select(Checkpoint.job_id, func.count(Checkpoint.id))
                .where(Checkpoint.job_id.in_([j.id for j in jobs]))
                .group_by(Checkpoint.job_id)
            ).all()
        )
    now = utcnow()
    attempts = usage.attempts_of(session, [j.id for j in jobs])
    queues = queue.queue_infos(session, [j for j in jobs if j.status == JobStatus.queued],
                               _settings_of(session, settings), now)
    return [
        job_object(j, counts.get(j.id, 0), now, attempts.get(j.id), settings, queues.get(j.id))
        for j in jobs
    ]


def _settings_of(session: Session, settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    given: Settings | None = session.info.get("settings")
    if given is not None:
        return given
    from core.infra.settings import get_settings

    return get_settings()


# The hot reads (every poll of a job) use statements built once: building one per call, with
# its cache key, costs SQLAlchemy several times what SQLite spends answering it.
_TENANT_JOB = select(Job).where(
    Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id")
)
_CHECKPOINTS_COUNT = select(func.count(Checkpoint.id)).where(
    Checkpoint.job_id == bindparam("job_id")
)
# GET /v1/jobs/{id} reads rows of the jobs and job_attempts tables, not ORM instances: a
# row has each column as an attribute (the models name attributes as their columns), and
# loading instances cost the ORM twice what SQLite spends answering (0.55 vs 0.26 ms a job
# here). The job, its checkpoint count and its attempts come in one statement (a row per
# attempt, the job's columns repeated): on PostgreSQL every statement is a round trip,
# whose wait and wake-up cost the API more CPU than the query's rows (a second statement
# for the attempts was one of GET job's seven round trips there). It runs on the driver's
# cursor (DriverSelect): SQLAlchemy's execution of it cost more than the driver's.
_ATTEMPT_COLUMNS = ("started_at", "ended_at", "processes", "tokens", "loss_tokens")
_JOB_ROW = DriverSelect(
    select(
        *Job.__table__.c,
        select(func.count(Checkpoint.id)).where(Checkpoint.job_id == Job.id)
        .correlate(Job).scalar_subquery().label("checkpoints_count"),
        *(JobAttempt.__table__.c[c].label(f"attempt_{c}") for c in _ATTEMPT_COLUMNS),
    )
    .outerjoin(JobAttempt, JobAttempt.job_id == Job.id)
    .where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))
    .order_by(JobAttempt.attempt)
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class _AttemptRow:
    """What usage.job_totals reads of an attempt, from a row of _JOB_ROW."""

    job_id: str
    started_at: datetime
    ended_at: datetime | None
    processes: int
    tokens: int
    loss_tokens: int


def find_tenant_job(session: Session, tenant_id: str, job_id: str) -> Job | None:
    return session.scalar(_TENANT_JOB, {"job_id": job_id, "tenant_id": tenant_id})


def get_job_object(session: Session, job: Job, settings: Settings | None = None) -> JobObject:
    count = session.scalar(_CHECKPOINTS_COUNT, {"job_id": job.id}) or 0
    attempts = usage.attempts_of(session, [job.id])[job.id]
    return _with_queue(session, job, count, attempts, settings)


def read_job_object(session: Session, tenant_id: str, job_id: str,
                    settings: Settings | None = None) -> JobObject | None:
    """GET /v1/jobs/{id}: the tenant's job as the API shows it, or None."""
    rows = _JOB_ROW.rows(session, {"job_id": job_id, "tenant_id": tenant_id})
    if not rows:
        return None
    row = rows[0]
    attempts = [
        _AttemptRow(row.id, r.attempt_started_at, r.attempt_ended_at, r.attempt_processes,
                    r.attempt_tokens, r.attempt_loss_tokens)
        for r in rows if r.attempt_started_at is not None
    ]  # fmt: skip
    # Rows stand in for the models they have the columns of (see _JOB_ROW).
    return _with_queue(session, cast(Job, row), row.checkpoints_count or 0,
                       cast(list[JobAttempt], attempts), settings)


def shows_own_rows_only(job: JobObject) -> bool:
    """Whether ``job`` as read shows nothing but its own rows (the job, its attempts and
    checkpoints) and the clock: every status but queued, whose place and reason in the
    queue come from other jobs, the workers and the tenant's limits (api/readcache.py)."""
    return job.status != JobStatus.queued


def _with_queue(session: Session, job: Job, checkpoints: int, attempts: list[JobAttempt],
                settings: Settings | None) -> JobObject:
    now = utcnow()
    info = (queue.queue_infos(session, [job], _settings_of(session, settings), now).get(job.id)
            if job.status == JobStatus.queued else None)
    return job_object(job, checkpoints, now, attempts, settings, info)


def list_jobs(
    session: Session,
    tenant: Tenant,
    status: JobStatus | None,
    limit: int,
    after: str | None,
    settings: Settings | None = None,
) -> Page[JobObject]:
    q = select(Job).where(Job.tenant_id == tenant.id)
    if status is not None:
        q = q.where(Job.status == status)
    rows, has_more = page_after(session, q, Job, tenant.id, limit, after)
    return Page(
        data=job_objects(session, rows, settings),
        has_more=has_more,
        next_cursor=rows[-1].id if has_more else None,
    )



# --------------------------------------------------------------------------- events, checkpoints


def event_object(e: JobEvent) -> EventObject:
    return EventObject(
        id=e.id, created_at=e.created_at, type=e.type, message=e.message or "", data=e.data or {}
    )


def events_after(session: Session, job_id: str, after: int | None, limit: int) -> list[JobEvent]:
    """Up to ``limit`` of the job's events after event ``after``, oldest first."""
    return event_page(session, job_id, limit, after=after)


def event_page(session: Session, job_id: str, limit: int, *, after: int | None = None,
               before: int | None = None, newest_first: bool = False) -> list[JobEvent]:
    """A page of one job's events by id (``after`` < id < ``before``).

    The ids come from ix_job_events_job_id_id alone (an index-only read), then their rows:
    asked for the rows at once, PostgreSQL read the primary key in id order and filtered by
    job, every older (or newer) event of the whole table first, whenever it judged the job to
    hold many events (35 ms instead of 0.3 ms for a page of a job with 100,000 events)."""
    ids = select(JobEvent.id).where(JobEvent.job_id == job_id)
    if after is not None:
        ids = ids.where(JobEvent.id > after)
    if before is not None:
        ids = ids.where(JobEvent.id < before)
    order = JobEvent.id.desc() if newest_first else JobEvent.id
    ids = ids.order_by(order).limit(limit)
    return list(session.scalars(
        select(JobEvent).where(JobEvent.id.in_(ids.scalar_subquery())).order_by(order)))


def list_events(session: Session, job: Job, after: int | None, limit: int) -> Page[EventObject]:
    rows = events_after(session, job.id, after, limit + 1)
    has_more = len(rows) > limit
    rows = rows[:limit]
    return Page(
        data=[event_object(e) for e in rows],
        has_more=has_more,
        next_cursor=str(rows[-1].id) if has_more else None,
    )


def is_terminal(status: str) -> bool:
    return jobstate.is_finished(status)


def relative_to_job_dir(job: Job, path: str) -> str:
    """Checkpoint paths are recorded absolute by the worker; clients see them relative."""
    p = Path(path)
    if not job.job_dir or not p.is_absolute():
        return path
    for root, candidate in ((Path(job.job_dir), p), (Path(job.job_dir).resolve(), p.resolve())):
        if candidate.is_relative_to(root):
            return str(candidate.relative_to(root))
    return p.name


def list_checkpoints(session: Session, job: Job) -> Page[CheckpointObject]:
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)
    ).all()
    return Page(
        data=[
            CheckpointObject(
                step=c.step,
                path=relative_to_job_dir(job, c.path),
                metrics=c.metrics or {},
                created_at=c.created_at,
            )
            for c in rows
        ]
    )
