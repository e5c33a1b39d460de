"""Claim: the guarded queued -> running transition that makes one delivery of a job this
worker's run, and the guard every later write of that run carries."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement

from core import jobstate
from core.db.models import Job, JobStatus, utcnow
from core.db.session import session_scope
from core.settings import Settings, get_settings
from worker.monitor import ACTIVE

log = logging.getLogger(__name__)


def worker_identity(settings: Settings | None = None) -> str:
    settings = settings or get_settings()
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Claim:
    job_id: str
    tenant_id: str
    worker_id: str
    attempt: int
    spec: dict[str, Any]
    started_at: datetime
    paused_seconds: float = 0.0  # time spent paused since started_at: outside the time limit


def claim_job(job_id: str, worker_id: str, *, max_attempts: int) -> Claim | None:
    """queued -> running for exactly one caller. None when the job is not (or no longer)
    this worker's to run: duplicate delivery, already running elsewhere, finished,
    cancelled, or out of attempts (then it is failed with worker_lost here)."""
    now = utcnow()
    with session_scope() as s:
        claimed = jobstate.claim(s, job_id, worker_id=worker_id, max_attempts=max_attempts,
                                 now=now)
        job = s.get(Job, job_id, populate_existing=True)
        if job is None:
            log.warning("job %s: no such job; message dropped", job_id)
            return None
        if claimed:
            assert job.started_at is not None
            return Claim(job.id, job.tenant_id, worker_id, job.attempt, dict(job.spec),
                         job.started_at, float(job.paused_seconds or 0.0))
        if job.status == JobStatus.queued and job.cancel_requested_at is not None:
            jobstate.honour_cancel_queued(s, job_id, now=now)
        elif job.status == JobStatus.queued and job.attempt - job.pauses >= max_attempts:
            paused = f", {job.pauses} more ended by a pause" if job.pauses else ""
            msg = (f"gave up after {job.attempt - job.pauses} attempts{paused} "
                   f"(max_attempts={max_attempts})")
            jobstate.give_up(s, job_id, max_attempts=max_attempts, now=now, message=msg)
        else:
            log.info("job %s is %s (worker %s); not claimed", job_id, job.status, job.worker_id)
        return None


def holder(claim: Claim) -> jobstate.Holder:
    """Who the state machine lets finish, requeue or mark cancelling this job."""
    return jobstate.Holder(claim.worker_id, claim.attempt)


def held_by(claim: Claim) -> list[ColumnElement[bool]]:
    """Guards every write a run makes once the job is claimed: still this worker's attempt,
    still active."""
    return [Job.worker_id == claim.worker_id, Job.attempt == claim.attempt,
            Job.status.in_(ACTIVE)]
