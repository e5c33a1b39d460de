"""The fleet, for admins: registered workers with what each GPU is running, and drain."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from api.schemas import WorkerGpu, WorkerObject
from core.db.models import WORKER_GONE, GpuAllocation, Worker, WorkerState
from core.db.session import execute_rowcount
from core.infra.errors import Conflict, NotFound


def list_workers(session: Session) -> list[WorkerObject]:
    rows = {(a.worker_id, a.gpu_index): a for a in session.scalars(select(GpuAllocation))}
    held = {k: a.job_id for k, a in rows.items() if a.job_id is not None}
    serving = {k: a.deployment_id for k, a in rows.items() if a.deployment_id is not None}
    out = []
    for w in session.scalars(select(Worker).order_by(Worker.id)):
        jobs = sorted({job for (wid, _), job in held.items() if wid == w.id})
        out.append(
            WorkerObject(
                id=w.id,
                host=w.host,
                executor=w.executor,
                state=w.state,
                gpus=[
                    WorkerGpu(
                        index=int(g["index"]),
                        name=str(g.get("name", "")),
                        memory_mb=int(g.get("memory_mb", 0)),
                        job_id=held.get((w.id, int(g["index"]))),
                        deployment_id=serving.get((w.id, int(g["index"]))),
                    )
                    for g in w.gpus or []
                ],
                cpu_cores=w.cpu_cores,
                capabilities=dict(w.capabilities or {}),
                slots=w.slots,
                running_jobs=jobs,
                started_at=w.started_at,
                heartbeat_at=w.heartbeat_at,
            )
        )
    return out


def set_draining(session: Session, worker_id: str, draining: bool) -> WorkerObject:
    """Drain: the worker takes no new job; its running jobs finish. Undrain: active again.
    Idempotent; a lost worker is a 409 (it is not there to drain)."""
    worker = session.get(Worker, worker_id)
    if worker is None:
        raise NotFound(f"no worker {worker_id!r}", param="worker_id")
    if worker.state in WORKER_GONE:
        raise Conflict(f"worker {worker_id!r} is {worker.state}", param="worker_id")
    to = WorkerState.draining if draining else WorkerState.active
    execute_rowcount(
        session,
        update(Worker)
        .where(Worker.id == worker_id, Worker.state.not_in(WORKER_GONE))
        .values(state=to)
        .execution_options(synchronize_session=False),
    )
    session.expire_all()
    return next(w for w in list_workers(session) if w.id == worker_id)
