"""A job's `phase`: what it is doing right now, from its status and the trainer's latest
"phase" event (folded into jobs.phase by the worker)."""

from __future__ import annotations

from api.schemas import JobPhase
from core.db.models import Job, JobStatus


def job_phase(job: Job) -> JobPhase | None:
    if job.status == JobStatus.queued:
        return JobPhase(phase="queued", message="queued: waiting for a worker")
    if job.status != JobStatus.running:
        return None
    latest = job.phase or {}
    # An earlier attempt's phase says nothing about this one.
    if latest.get("phase") and latest.get("attempt") in (None, job.attempt):
        fields = {k: latest.get(k) for k in ("loaded", "total", "shards")}
        return JobPhase(phase=str(latest["phase"]),
                        message=str(latest.get("message") or latest["phase"]),
                        **{k: v for k, v in fields.items() if isinstance(v, int)})
    return JobPhase(phase="starting", message="starting: the worker is launching the trainer")
