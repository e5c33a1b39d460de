"""Claim: the guarded queued -> running transition that makes one delivery of a job this
worker's run, and the guard every later write of that run carries."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, literal

from core.db.models import Job, JobStatus, UTCDateTime, utcnow
from core.db.session import session_scope
from core.errors import ErrorCode
from core.settings import Settings, get_settings
from worker.monitor import ACTIVE
from worker.transitions import transition

log = logging.getLogger(__name__)


def worker_identity(settings: Settings | None = None) -> str:
    settings = settings or get_settings()
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


def _now_param(now: datetime) -> Any:
    return literal(now, type_=UTCDateTime())


@dataclass(frozen=True)
class Claim:
    job_id: str
    tenant_id: str
    worker_id: str
    attempt: int
    spec: dict[str, Any]
    started_at: datetime


def claim_job(job_id: str, worker_id: str, *, max_attempts: int) -> Claim | None:
    """queued -> running for exactly one caller. None when the job is not (or no longer)
    this worker's to run: duplicate delivery, already running elsewhere, finished,
    cancelled, or out of attempts (then it is failed with worker_lost here)."""
    now = utcnow()
    with session_scope() as s:
        claimed = transition(
            s, job_id, to=JobStatus.running, previous=JobStatus.queued,
            guard=[Job.status == JobStatus.queued, Job.cancel_requested_at.is_(None),
                   Job.attempt < max_attempts],
            values={
                "worker_id": worker_id,
                "attempt": Job.attempt + 1,
                "started_at": _started_at_or(now),
                "heartbeat_at": now,
                "finished_at": None,
                "error_code": None,
                "error_message": None,
            },
            event_data={"worker_id": worker_id},
        )
        job = s.get(Job, job_id, populate_existing=True)
        if job is None:
            log.warning("job %s: no such job; message dropped", job_id)
            return None
        if claimed:
            assert job.started_at is not None
            return Claim(job.id, job.tenant_id, worker_id, job.attempt, dict(job.spec),
                         job.started_at)
        if job.status == JobStatus.queued and job.cancel_requested_at is not None:
            transition(s, job_id, to=JobStatus.cancelled, previous=JobStatus.queued,
                       guard=[Job.status == JobStatus.queued,
                              Job.cancel_requested_at.is_not(None)],
                       values={"finished_at": now, "worker_id": None})
        elif job.status == JobStatus.queued and job.attempt >= max_attempts:
            msg = f"gave up after {job.attempt} attempts (max_attempts={max_attempts})"
            transition(s, job_id, to=JobStatus.failed, previous=JobStatus.queued,
                       guard=[Job.status == JobStatus.queued, Job.attempt >= max_attempts],
                       values={"finished_at": now, "worker_id": None,
                               "error_code": ErrorCode.worker_lost, "error_message": msg},
                       event_data={"error_code": ErrorCode.worker_lost})
        else:
            log.info("job %s is %s (worker %s); not claimed", job_id, job.status, job.worker_id)
        return None


def _started_at_or(now: datetime) -> Any:
    return func.coalesce(Job.started_at, _now_param(now))


def held_by(claim: Claim) -> list[ColumnElement[bool]]:
    """Guards every write a run makes once the job is claimed: still this worker's attempt,
    still active."""
    return [Job.worker_id == claim.worker_id, Job.attempt == claim.attempt,
            Job.status.in_(ACTIVE)]
