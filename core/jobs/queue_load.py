"""The scheduler's view of the database: what a decision reads (the workers with what their
running jobs hold, the first ``QUEUE_WINDOW`` queued jobs in queue order with their parsed
specs and checkpoints, the tenants' running counts), and the lock that makes decisions one
at a time. core/jobs/scheduler.py plans on what this loads and reads no database itself.

The queue is read in the order of the ix_jobs_queue index (status, priority DESC,
created_at, id), so a decision reads its window of rows whether 100 or 10,000 jobs wait.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.db.models import (
    WORKER_GONE,
    GpuAllocation,
    Job,
    JobStatus,
    SchedulerLock,
    Tenant,
    Worker,
)
from core.infra.settings import Settings
from core.jobs.queue_model import (
    QUEUE_WINDOW,
    Candidate,
    FleetState,
    Holding,
    WorkerView,
    cpu_slot_index,
    free_by,
    resumable,
)
from core.jobs.state import HELD
from core.policy.fleet import Inventory
from core.run.checkpoints import Manifest
from core.run.jobdir import JobDir
from core.spec import JobSpec, stored_spec


def lock_decisions(session: Session) -> None:
    """Serialise scheduling decisions: the first statement of a decision's transaction is
    this UPDATE, which holds the row lock (PostgreSQL) or the database write lock (SQLite)
    until the decision commits."""
    session.execute(update(SchedulerLock).where(SchedulerLock.id == 1)
                    .values(decisions=SchedulerLock.decisions + 1)
                    .execution_options(synchronize_session=False))


def inventory_of(w: Worker) -> Inventory:
    memories = [int(g.get("memory_mb") or 0) for g in (w.gpus or [])]
    return Inventory(id=w.id, gpus=len(w.gpus or []), executor=w.executor, slots=w.slots,
                     capabilities=dict(w.capabilities or {}),
                     gpu_memory_mb=min(memories) if memories and min(memories) > 0 else 0)


def load_state(session: Session, settings: Settings, now: datetime,
               window: int = QUEUE_WINDOW) -> FleetState:
    workers, tenant_gpus = load_workers(session, settings, now)
    tenant_jobs = dict(session.execute(  # type: ignore[arg-type]
        select(Job.tenant_id, func.count(Job.id)).where(Job.status.in_(HELD))
        .group_by(Job.tenant_id)).all())
    rows = session.execute(
        select(Job.id, Job.tenant_id, Tenant.name, Job.priority, Job.created_at, Job.attempt,
               Job.pauses, Job.cancel_requested_at, Job.queued_at, Job.job_dir)
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.status == JobStatus.queued)
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(window)).all()
    specs = specs_of(session, {r.id: r.queued_at for r in rows})
    queue = []
    for r in rows:
        spec = specs.get(r.id)
        resume = None
        if spec is not None and spec.distributed.resume_on and r.attempt > 0 and r.job_dir:
            resume = resumable(spec, *_latest_manifest(r.id, r.attempt, r.job_dir))
        queue.append(Candidate(r.id, r.tenant_id, r.name, r.priority, r.created_at, r.attempt,
                               r.pauses, r.cancel_requested_at is not None, spec, resume))
    return FleetState(workers, queue, tenant_jobs, tenant_gpus)


def load_workers(session: Session, settings: Settings, now: datetime, *,
                 only: str | None = None) -> tuple[dict[str, WorkerView], dict[str, int]]:
    """The workers that are not lost (or only worker ``only``), with what their running jobs
    hold, and the GPUs each tenant's running jobs hold (all of them only without ``only``)."""
    stale_before = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    taken: dict[str, set[int]] = {}
    held_by: dict[str, dict[str, int]] = {}  # worker -> job -> GPUs it holds
    started: dict[str, tuple[datetime | None, float]] = {}
    versions: dict[str, datetime | None] = {}
    tenant_gpus: dict[str, int] = {}
    serving: dict[str, dict[str, int]] = {}  # worker -> deployment -> GPUs it holds
    allocations = (select(GpuAllocation.worker_id, GpuAllocation.gpu_index, GpuAllocation.job_id,
                          Job.tenant_id, Job.started_at, Job.paused_seconds, Job.queued_at,
                          GpuAllocation.deployment_id)
                   .outerjoin(Job, Job.id == GpuAllocation.job_id))
    rows = select(Worker).where(Worker.state.not_in(WORKER_GONE))
    if only is not None:
        allocations = allocations.where(GpuAllocation.worker_id == only)
        rows = rows.where(Worker.id == only)
    for wid, index, job_id, tenant_id, started_at, paused, queued_at, dep_id in \
            session.execute(allocations):
        taken.setdefault(wid, set()).add(index)
        if job_id is None:  # a deployment's GPU: taken, but no training slot or deadline
            held = serving.setdefault(wid, {})
            held[str(dep_id)] = held.get(str(dep_id), 0) + (index >= 0)
            continue
        jobs = held_by.setdefault(wid, {})
        jobs[job_id] = jobs.get(job_id, 0) + (index >= 0)
        started[job_id] = (started_at, paused or 0.0)
        versions[job_id] = queued_at
        tenant_gpus[tenant_id] = tenant_gpus.get(tenant_id, 0) + (index >= 0)
    running_specs = specs_of(session, versions)
    workers: dict[str, WorkerView] = {}
    for w in session.scalars(rows):
        busy = taken.get(w.id, set())
        indices = [int(g["index"]) for g in (w.gpus or [])]
        holding = [Holding(j, n, free_by(running_specs.get(j), *started[j], settings))
                   for j, n in held_by.get(w.id, {}).items()]
        workers[w.id] = WorkerView(
            inv=inventory_of(w), state=w.state, fresh=w.heartbeat_at >= stale_before,
            gpu_indices=indices, free_gpus=[i for i in indices if i not in busy],
            free_cpu_slots=[k for k in range(w.slots) if cpu_slot_index(k) not in busy],
            running=len(holding), holding=holding, serving=serving.get(w.id, {}))
    return workers, tenant_gpus


# A job's spec changes only while it is paused (POST /resume with another slice), and every
# resume queues it again with a new ``queued_at``: parse each (job, queued_at) once per
# process, not at every decision (a decision reads up to QUEUE_WINDOW queued jobs).
_SPEC_CACHE: dict[tuple[str, datetime | None], JobSpec | None] = {}
_SPEC_CACHE_MAX = 20_000
_spec_lock = threading.Lock()


def specs_of(session: Session,
             versions: dict[str, datetime | None]) -> dict[str, JobSpec | None]:
    """The parsed spec of each job of ``versions`` (job id -> its ``queued_at``)."""
    with _spec_lock:
        out = {j: _SPEC_CACHE[(j, v)] for j, v in versions.items() if (j, v) in _SPEC_CACHE}
    missing = [j for j in versions if j not in out]
    if missing:
        parsed: dict[tuple[str, datetime | None], JobSpec | None] = {}
        for job_id, raw in session.execute(select(Job.id, Job.spec).where(Job.id.in_(missing))):
            # None: the claim fails it with the reason.
            parsed[(job_id, versions[job_id])] = out[job_id] = stored_spec(raw)
        with _spec_lock:
            if len(_SPEC_CACHE) + len(parsed) > _SPEC_CACHE_MAX:
                _SPEC_CACHE.clear()
            _SPEC_CACHE.update(parsed)
    return out


# A queued job's latest checkpoint does not change until it runs again (its attempt moves
# on): read each (job, attempt)'s manifest once per process.
_MANIFESTS: dict[tuple[str, int], tuple[str, Manifest] | None] = {}


def _latest_manifest(job_id: str, attempt: int,
                     job_dir: str) -> tuple[str, Manifest] | tuple[None, None]:
    key = (job_id, attempt)
    with _spec_lock:
        if key in _MANIFESTS:
            return _MANIFESTS[key] or (None, None)
    latest = JobDir(Path(job_dir)).latest_checkpoint()
    found = None
    if latest is not None:
        try:
            manifest = Manifest.read(latest)
        except (OSError, ValueError, KeyError, TypeError):
            manifest = None  # unreadable: the run itself says why when it resumes
        found = (latest.name, manifest) if manifest is not None else None
    with _spec_lock:
        if len(_MANIFESTS) > _SPEC_CACHE_MAX:
            _MANIFESTS.clear()
        _MANIFESTS[key] = found
    return found or (None, None)
