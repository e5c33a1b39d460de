"""Repairs what a lost message or a lost worker left behind. Safe to run from any number of
processes at once: it reads candidates, then changes each with an UPDATE guarded by the
state it saw (still stale, same attempt), so only one reconciler acts on a job, and only
that one enqueues it.

* running/cancelling with a heartbeat older than heartbeat_timeout_seconds: the worker is
  gone. Cancel requested -> cancelled; attempts left -> queued again (it resumes from its
  latest checkpoint) and enqueued; else failed with worker_lost. A lost pausing job is
  paused, as its user asked: it resumes from its latest checkpoint when resumed.
* queued for longer than queued_requeue_seconds: the broker may have lost the message
  (e.g. Redis restarted without AOF): enqueue again and bump queued_at. A duplicate message
  is harmless, the claim is guarded.
* queued or cancelling with a cancel request and no worker: cancelled.

* On a SLURM worker: a live SLURM job whose job has ended (or is gone) is scancelled, e.g.
  a job cancelled while queued between a worker's exit and the next worker's adoption.
* a worker silent for heartbeat_timeout_seconds: marked lost (the scheduler places nothing
  on it; its jobs are lost above, which frees their GPUs); GPU allocations whose job no
  longer runs that attempt (a safety net: the job's move deletes them) are deleted.

A lost attempt's processes still alive on this machine (found by their launch tag) are
killed, whatever became of the job.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, or_, select, update

from core.db.models import (
    WORKER_GONE,
    GpuAllocation,
    Job,
    JobEvent,
    JobStatus,
    Worker,
    WorkerState,
    utcnow,
)
from core.db.session import execute_rowcount, session_scope
from core.evals.dispatch import resend_stale_runs
from core.infra.settings import get_settings
from core.jobs import state as jobstate
from core.jobs.dispatch import enqueue_after_commit
from core.serving.tables import RUNNING, Deployment, DeploymentState

log = logging.getLogger(__name__)

BATCH = 500


def reconcile(now: datetime | None = None) -> dict[str, int]:
    """One pass. Returns counts: requeued, failed, cancelled, paused, reenqueued,
    workers_lost, allocations_freed."""
    settings = get_settings()
    now = now or utcnow()
    hb_cutoff = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    q_cutoff = now - timedelta(seconds=settings.queued_requeue_seconds)
    counts = {"requeued": 0, "failed": 0, "cancelled": 0, "paused": 0, "reenqueued": 0}

    stale_hb = or_(Job.heartbeat_at < hb_cutoff, Job.heartbeat_at.is_(None))
    with session_scope() as s:
        lost = s.execute(
            select(Job.id, Job.status, Job.attempt, Job.pauses, Job.worker_id,
                   Job.heartbeat_at, Job.cancel_requested_at)
            .where(Job.status.in_(jobstate.HELD), or_(stale_hb, and_(
                Job.status == JobStatus.cancelling, Job.worker_id.is_(None))))
            .limit(BATCH)
        ).all()
    lost_attempts: list[str] = []
    for row in lost:
        since = (f"no heartbeat since {row.heartbeat_at.isoformat()}" if row.heartbeat_at
                 else "no heartbeat")
        who = f"worker {row.worker_id}" if row.worker_id else "no worker"
        to = jobstate.lost_status(row.status, cancel_requested=row.cancel_requested_at is not None,
                                  attempt=row.attempt, pauses=row.pauses,
                                  max_attempts=settings.max_attempts)
        if to == JobStatus.cancelled:
            message, count = f"{who}: {since}", "cancelled"
        elif to == JobStatus.paused:
            message, count = f"{who} lost ({since}) while pausing; paused", "paused"
        elif to == JobStatus.queued:
            count = "requeued"
            message = (f"{who} lost ({since}); requeued for attempt {row.attempt + 1} of "
                       f"{settings.max_attempts}")
        else:
            count = "failed"
            message = (f"{who} lost ({since}) on attempt {row.attempt} of "
                       f"{settings.max_attempts}; giving up")
        with session_scope() as s:
            if not jobstate.lose(s, row.id, previous=row.status, attempt=row.attempt, to=to,
                                 stale_before=hb_cutoff, now=now, message=message):
                continue
            if to == JobStatus.queued:
                s.add(JobEvent(job_id=row.id, type="requeued", message=message,
                               data={"attempt": row.attempt, "worker_id": row.worker_id}))
                enqueue_after_commit(s, row.id)
        counts[count] += 1
        lost_attempts.append(f"{row.id}:{row.attempt}:")

    if lost_attempts:
        _kill_leftovers(lost_attempts)
    counts["workers_lost"], counts["allocations_freed"] = _fleet(hb_cutoff)

    stale_q = or_(Job.queued_at < q_cutoff, and_(Job.queued_at.is_(None),
                                                  Job.created_at < q_cutoff))
    with session_scope() as s:
        waiting = s.execute(
            select(Job.id, Job.cancel_requested_at)
            .where(Job.status == JobStatus.queued,
                   or_(stale_q, Job.cancel_requested_at.is_not(None)))
            .limit(BATCH)
        ).all()
    for waiter in waiting:
        with session_scope() as s:
            if waiter.cancel_requested_at is not None:
                if jobstate.honour_cancel_queued(s, waiter.id, now=now):
                    counts["cancelled"] += 1
                continue
            bumped = execute_rowcount(s, _update_queued_at(waiter.id, now, stale_q))
            if bumped == 1:
                s.add(JobEvent(job_id=waiter.id, type="requeued",
                               message="queued too long; message sent again",
                               data={"reason": "queued_timeout"}))
                enqueue_after_commit(s, waiter.id)
                counts["reenqueued"] += 1

    if settings.slurm_enabled:
        from worker.slurm.orphans import cancel_orphans

        try:
            counts["slurm_orphans"] = len(cancel_orphans())
        except Exception:
            log.exception("reconciler: could not look for orphan SLURM jobs")
    if any(counts.values()):
        log.info("reconciler: %s", counts)
    counts["eval_runs_resent"] = resend_stale_runs(settings.eval_stale_seconds)
    return counts


def _fleet(hb_cutoff: datetime) -> tuple[int, int]:
    """Silent workers are lost; allocations of jobs no longer running that attempt go."""
    with session_scope() as s:
        lost = execute_rowcount(s, update(Worker).where(
            Worker.state.not_in(WORKER_GONE), Worker.heartbeat_at < hb_cutoff)
            .values(state=WorkerState.lost).execution_options(synchronize_session=False))
        live = select(Job.id).where(Job.id == GpuAllocation.job_id,
                                    Job.attempt == GpuAllocation.attempt,
                                    Job.status.in_(jobstate.HELD))
        freed = execute_rowcount(s, delete(GpuAllocation).where(
            GpuAllocation.job_id.is_not(None), ~exists(live))
                                 .execution_options(synchronize_session=False))
        # A deployment's GPUs are freed as it stops (worker/serve/); these are those of one
        # whose worker died, once a request took it over.
        serving = select(Deployment.id).where(
            Deployment.id == GpuAllocation.deployment_id,
            Deployment.worker_id == GpuAllocation.worker_id,
            Deployment.state.in_([*RUNNING, DeploymentState.stopping]))
        freed += execute_rowcount(s, delete(GpuAllocation).where(
            GpuAllocation.deployment_id.is_not(None), ~exists(serving))
            .execution_options(synchronize_session=False))
    if lost or freed:
        log.warning("reconciler: %d worker(s) lost, %d orphan GPU allocation(s) freed",
                    lost, freed)
    return lost, freed


def _kill_leftovers(tag_prefixes: list[str]) -> None:
    """Kill what a lost attempt left running on this machine (a rank whose worker was
    SIGKILLed exits by itself, core/train/lifeline.py; its own children may not). The
    prefix names the attempt, so a newer attempt of the same job is never touched."""
    from worker.run import process_tree

    for prefix in tag_prefixes:
        try:
            n = process_tree.kill_tagged(prefix)
        except Exception:
            log.exception("reconciler: could not look for leftovers of %s", prefix)
            continue
        if n:
            log.warning("reconciler: killed %d leftover process(es) of job attempt %s",
                        n, prefix.rstrip(":"))


def _update_queued_at(job_id: str, now: datetime, stale_q: Any) -> Any:
    return (update(Job)
            .where(Job.id == job_id, Job.status == JobStatus.queued, stale_q)
            .values(queued_at=now)
            .execution_options(synchronize_session=False))
