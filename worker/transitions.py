"""Job status transitions: a guarded UPDATE plus a "status" event row, in one transaction.

The database is the source of truth. Every change of a job's status is an UPDATE whose
WHERE clause states what the writer believes (status, attempt, holding worker, stale
heartbeat); if another process changed the job first, the UPDATE matches no row and the
writer does nothing. That is what makes duplicate deliveries, concurrent reconcilers and a
worker that lost its job harmless.

    queued     -> running     claim (worker)        status=queued, no cancel, attempt<max
    queued     -> failed      claim (worker)        status=queued, attempt>=max (worker_lost)
    queued     -> cancelled   claim / reconciler    status=queued, cancel requested
    running    -> cancelling  worker monitor        id, worker_id, attempt, status=running
    running|cancelling -> succeeded | failed | cancelled
                              worker finish         id, worker_id, attempt, status in both
    running|cancelling -> queued
                              worker shutdown       id, worker_id, attempt, status in both
    running    -> queued | failed (worker_lost)
                              reconciler            status, attempt, heartbeat still stale
    cancelling -> cancelled   reconciler            status, attempt, heartbeat still stale
                                                    (or no worker)

A requeue keeps ``attempt``: the next claim increments it, and a claim at max_attempts
fails the job instead.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, update
from sqlalchemy.orm import Session

from core.db.models import Job, JobEvent
from core.db.session import execute_rowcount


def _status_event(job_id: str, to: str, previous: str | None, **data: Any) -> JobEvent:
    msg = f"{previous} -> {to}" if previous else to
    if data.get("error_code"):
        msg += f" ({data['error_code']})"
    return JobEvent(job_id=job_id, type="status", message=msg,
                    data={"status": to, "previous": previous,
                          **{k: v for k, v in data.items() if v is not None}})


def transition(session: Session, job_id: str, *, to: str, previous: str | None,
               guard: list[ColumnElement[bool]], values: dict[str, Any] | None = None,
               event_data: dict[str, Any] | None = None) -> bool:
    """Guarded UPDATE to status ``to`` plus a "status" event, in the caller's transaction.
    False (and nothing written) if the guard no longer holds."""
    n = execute_rowcount(
        session,
        update(Job).where(Job.id == job_id, *guard).values(status=to, **(values or {}))
        .execution_options(synchronize_session=False),
    )
    if n != 1:
        return False
    session.add(_status_event(job_id, to, previous, **(event_data or {})))
    return True
