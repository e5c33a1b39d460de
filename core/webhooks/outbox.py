"""The webhook outbox: events are rows written in the caller's transaction (the one that
changes the job), one delivery row per subscribed endpoint. A rolled-back change leaves no
event; a committed one is delivered at least once by the sender, under the event's id."""

from __future__ import annotations

import base64
import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import (
    Job,
    JobStatus,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    new_id,
    utcnow,
)

# A job's new status -> the event it sends. The one table: a new status with an event
# (e.g. paused) is one more line here.
STATUS_EVENTS: dict[str, str] = {
    JobStatus.running: "job.running",
    JobStatus.succeeded: "job.succeeded",
    JobStatus.failed: "job.failed",
    JobStatus.cancelled: "job.cancelled",
    JobStatus.paused: "job.paused",
}
# Moves whose meaning the new status does not tell (a resumed job is just "queued" again).
MOVE_EVENTS: dict[str, str] = {"resume": "job.resumed"}
CHECKPOINT_EVENT = "job.checkpoint"
TEST_EVENT = "webhook.test"
# OpenAI's names for the same moves, with OpenAI's payload ({id, object: "event", created_at,
# type, data: {id}}), for receivers written against OpenAI's webhooks.
OPENAI_STATUS_EVENTS: dict[str, str] = {
    JobStatus.succeeded: "fine_tuning.job.succeeded",
    JobStatus.failed: "fine_tuning.job.failed",
    JobStatus.cancelled: "fine_tuning.job.cancelled",
}
# ftune's own events, with ftune's payload.
JOB_EVENT_TYPES: tuple[str, ...] = (*STATUS_EVENTS.values(), *MOVE_EVENTS.values(),
                                    CHECKPOINT_EVENT)
# What an endpoint may subscribe to. The test event goes to the endpoint it was asked for.
EVENT_TYPES: tuple[str, ...] = (*JOB_EVENT_TYPES, *OPENAI_STATUS_EVENTS.values())
DEFAULT_EVENT_TYPES: tuple[str, ...] = ("job.succeeded", "job.failed", "job.cancelled")


def new_secret() -> str:
    """A signing secret as Standard Webhooks writes it: ``whsec_`` + base64 of 24 bytes."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def job_summary(session: Session, job_id: str) -> tuple[str, dict[str, Any]] | None:
    """(tenant id, the job as an event shows it), read inside the caller's transaction."""
    row = session.execute(
        select(Job.tenant_id, Job.id, Job.name, Job.status, Job.attempt, Job.created_at,
               Job.started_at, Job.finished_at, Job.step, Job.total_steps, Job.error_code,
               Job.error_message, Job.adapter_path)
        .where(Job.id == job_id)
    ).one_or_none()
    if row is None:
        return None
    error = {"code": row.error_code, "message": row.error_message or ""} if row.error_code else None
    return row.tenant_id, {
        "object": "job",
        "id": row.id,
        "name": row.name,
        "status": row.status,
        "attempt": row.attempt,
        "created_at": _iso(row.created_at),
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
        "progress": {"step": row.step, "total_steps": row.total_steps},
        "adapter_available": row.status == JobStatus.succeeded and row.adapter_path is not None,
        "error": error,
    }


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t is not None else None


def job_status_changed(session: Session, job_id: str, status: str,
                       move: str = "") -> WebhookEvent | None:
    """Called by core/jobs/state.py after each move: the event for the move or the new
    status, if any."""
    if status in OPENAI_STATUS_EVENTS:
        _openai_job_event(session, job_id, OPENAI_STATUS_EVENTS[status])
    event_type = MOVE_EVENTS.get(move) or STATUS_EVENTS.get(status)
    if event_type is None:
        return None
    return _job_event(session, job_id, event_type)


def _openai_job_event(session: Session, job_id: str, event_type: str) -> WebhookEvent | None:
    tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == job_id))
    if tenant_id is None:
        return None
    endpoints = subscribed(session, tenant_id, event_type)
    if not endpoints:
        return None
    now = utcnow()
    event_id = new_id("evt")
    return record(session, tenant_id, event_type, {"id": job_id}, endpoints, now=now,
                  event_id=event_id,
                  payload={"id": event_id, "object": "event", "created_at": int(now.timestamp()),
                           "type": event_type, "data": {"id": job_id}})


def job_checkpoint(session: Session, job_id: str, step: int,
                   metrics: dict[str, Any]) -> WebhookEvent | None:
    """Called where a checkpoint is recorded (worker/run/ingest.py)."""
    return _job_event(session, job_id, CHECKPOINT_EVENT,
                      checkpoint={"step": step, "metrics": metrics})


def _job_event(session: Session, job_id: str, event_type: str,
               **extra: Any) -> WebhookEvent | None:
    found = job_summary(session, job_id)
    if found is None:
        return None
    tenant_id, data = found
    endpoints = subscribed(session, tenant_id, event_type)
    if not endpoints:
        return None  # nobody listens: no row
    return record(session, tenant_id, event_type, {**data, **extra}, endpoints)


def subscribed(session: Session, tenant_id: str, event_type: str) -> list[str]:
    rows = session.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.event_types)
        .where(WebhookEndpoint.tenant_id == tenant_id)
    ).all()
    return [r.id for r in rows if event_type in (r.event_types or [])]


def record(session: Session, tenant_id: str, event_type: str, data: dict[str, Any],
           endpoint_ids: list[str], *, now: datetime | None = None,
           event_id: str | None = None, payload: dict[str, Any] | None = None) -> WebhookEvent:
    """One event and a pending delivery to each endpoint, in the caller's transaction. The
    payload is the body every delivery sends: ``{id, type, timestamp, data}`` unless given
    (OpenAI's events have their own)."""
    now = now or utcnow()
    event_id = event_id or new_id("msg")
    event = WebhookEvent(
        id=event_id, tenant_id=tenant_id, type=event_type, created_at=now,
        payload=payload or {"id": event_id, "type": event_type, "timestamp": now.isoformat(),
                            "data": data},
    )
    session.add(event)
    session.flush()  # the event first: deliveries refer to it
    for endpoint_id in endpoint_ids:
        session.add(WebhookDelivery(event_id=event_id, endpoint_id=endpoint_id,
                                    next_attempt_at=now, created_at=now))
    session.flush()
    return event
