"""Commands on jobs: submit (record, enqueue after commit), cancel, pause, resume."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.services.jobs.submit_checks import check_on_server, parse_body
from api.services.placement import with_placement
from api.services.rate_limits import check_job_rate
from core.db.models import (
    Job,
    JobStatus,
    Tenant,
    new_id,
    utcnow,
)
from core.db.session import savepoint
from core.infra.errors import Conflict
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.jobs.continuation import with_source_defaults
from core.jobs.dispatch import enqueue_after_commit
from core.spec import (
    resolved_spec,
)

log = logging.getLogger("ftune.api")

Enqueue = Callable[[str], None]


def submit_job(
    session: Session,
    tenant: Tenant,
    body: Any,
    *,
    settings: Settings,
    idempotency_key: str | None = None,
    enqueue: Enqueue | None = None,
) -> tuple[Job, bool]:
    """Validate a spec against the request and the server, queue it. Returns (job, created).

    Every problem (field, cross-field, files, paths, data rows) comes back in one SpecError."""
    spec, problems = parse_body(with_source_defaults(session, tenant.id, body))
    placed = None
    if spec is not None and isinstance(body, dict) and "distributed" not in body:
        # Not asked: admission chooses (api/services/placement.py) and says so.
        spec, placed = with_placement(session, settings, spec)
    stored = spec.model_dump(mode="json", exclude_unset=True) if spec is not None else None
    if idempotency_key is not None and stored is not None:
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is not None:
            return _replay(existing, stored, idempotency_key), False

    if spec is not None:
        check_job_rate(session, tenant, settings)
    summary = check_on_server(session, tenant, settings, body, spec, problems)
    assert spec is not None and stored is not None

    now = utcnow()
    job = Job(
        id=new_id("job"),
        tenant_id=tenant.id,
        name=spec.name,
        spec=stored,
        request=body,
        resolved_spec=resolved_spec(spec),
        idempotency_key=idempotency_key,
        created_at=now,
        priority=spec.priority,
        data_receipt=summary.data,
    )
    try:
        # A savepoint: the same Idempotency-Key committed concurrently fails only this insert.
        with savepoint(session):
            event_data = summary.to_dict()
            if placed is not None:
                event_data["placement"] = {"strategy": placed.strategy,
                                           "num_processes": placed.num_processes,
                                           "reason": placed.reason}
            jobstate.queue(session, job, now=now, event_data=event_data)
    except IntegrityError:
        if idempotency_key is None:
            raise
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is None:
            raise
        return _replay(existing, stored, idempotency_key), False
    enqueue_after_commit(session, job.id, enqueue)
    return job, True



def _by_idempotency_key(session: Session, tenant: Tenant, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant_id == tenant.id, Job.idempotency_key == key))


def _replay(existing: Job, stored: dict[str, Any], key: str) -> Job:
    if existing.spec != stored:
        raise Conflict(
            f"Idempotency-Key {key!r} was used for job {existing.id} with a different body",
            code="idempotency_conflict",
            param="Idempotency-Key",
        )
    return existing



# --------------------------------------------------------------------------- cancel


def cancel_job(session: Session, job: Job) -> Job:
    """Idempotent: queued or paused -> cancelled now; running or pausing -> cancelling (the
    worker stops it); cancelling or finished -> unchanged. Each move is guarded by the
    status it was read in, so a job that changes state meanwhile (a worker claims it) is
    handled in its new state."""
    for _ in range(3):
        previous = job.status
        if previous not in (JobStatus.queued, JobStatus.running, JobStatus.paused,
                            JobStatus.pausing):
            return job
        changed = jobstate.request_cancel(session, job.id, previous=previous, now=utcnow())
        session.refresh(job)
        if changed:
            return job
    return job


# --------------------------------------------------------------------------- pause, resume


def pause_job(session: Session, job: Job) -> Job:
    """Idempotent: queued -> paused now; running -> pausing (its worker stops the trainer at
    a checkpoint, then marks it paused); pausing or paused -> unchanged. Conflict from any
    other status. Guarded by the status it was read in, like a cancel."""
    for _ in range(3):
        previous = job.status
        if previous in (JobStatus.pausing, JobStatus.paused):
            return job
        if previous not in (JobStatus.queued, JobStatus.running):
            raise Conflict(f"job {job.id} is {previous}: only a queued or running job can be "
                           "paused", code="job_not_pausable", param="status")
        changed = jobstate.request_pause(session, job.id, previous=previous, now=utcnow())
        session.refresh(job)
        if changed:
            return job
    return job


def resume_job(session: Session, job: Job, enqueue: Enqueue | None = None) -> Job:
    """Idempotent: paused -> queued, enqueued after the commit (any worker continues from
    the latest checkpoint); queued or running -> unchanged. Conflict while the pause is
    still being enforced (pausing) and from any other status."""
    for _ in range(3):
        previous = job.status
        if previous in (JobStatus.queued, JobStatus.running):
            return job
        if previous == JobStatus.pausing:
            raise Conflict(f"job {job.id} is still pausing (its worker is saving a checkpoint "
                           "and stopping the run): resume it once it is paused",
                           code="job_not_resumable", param="status")
        if previous != JobStatus.paused:
            raise Conflict(f"job {job.id} is {previous}: only a paused job can be resumed",
                           code="job_not_resumable", param="status")
        changed = jobstate.resume(session, job.id, now=utcnow())
        session.refresh(job)
        if changed:
            enqueue_after_commit(session, job.id, enqueue)
            return job
    return job
