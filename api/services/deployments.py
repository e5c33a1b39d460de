"""The deployments (engine servers), for admins: list them, and stop one. A stop is a guarded
move of its row (core/serving/deployments.py ``stop``); the worker running it stops the
engine's whole process tree and frees its GPUs; the next request for its model starts it
again (scale from zero)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import GpuAllocation
from core.infra.errors import NotFound
from core.serving import deployments
from core.serving.tables import Deployment


class DeploymentObject(BaseModel):
    id: str
    kind: str = Field(description="base (serves every tenant's adapters on it) or full")
    model: str = Field(description="What the engine loads (--model)")
    job_id: str | None
    state: str = Field(description="requested, starting, ready, stopping, stopped or failed")
    worker_id: str | None
    gpus: list[int] = Field(description="GPU indices it holds on its worker ([] on a CPU one)")
    memory_mb: int = Field(description="Weights + KV cache, as placed")
    keep_warm: bool
    restarts: int
    waiting: str | None = Field(description="Why a requested deployment is not placed yet")
    error: str | None
    requested_at: datetime
    ready_at: datetime | None
    last_used_at: datetime
    stopped_at: datetime | None


def _object(dep: Deployment, gpus: list[int]) -> DeploymentObject:
    return DeploymentObject(
        id=dep.id, kind=dep.kind, model=dep.location, job_id=dep.job_id, state=dep.state,
        worker_id=dep.worker_id, gpus=gpus, memory_mb=dep.memory_mb, keep_warm=dep.keep_warm,
        restarts=dep.restarts, waiting=dep.waiting, error=dep.error,
        requested_at=dep.requested_at, ready_at=dep.ready_at, last_used_at=dep.last_used_at,
        stopped_at=dep.stopped_at)


def _gpus(session: Session) -> dict[str, list[int]]:
    held: dict[str, list[int]] = {}
    for dep_id, index in session.execute(select(
            GpuAllocation.deployment_id, GpuAllocation.gpu_index).where(
            GpuAllocation.deployment_id.is_not(None)).order_by(GpuAllocation.gpu_index)):
        held.setdefault(str(dep_id), []).append(index)
    return held


def list_deployments(session: Session) -> list[DeploymentObject]:
    held = _gpus(session)
    return [_object(d, held.get(d.id, []))
            for d in session.scalars(select(Deployment).order_by(Deployment.requested_at))]


def stop_deployment(session: Session, deployment_id: str) -> DeploymentObject:
    """Idempotent: a deployment already stopped (or failed) is returned as it is."""
    if session.get(Deployment, deployment_id) is None:
        raise NotFound(f"no deployment {deployment_id!r}", param="deployment_id")
    deployments.stop(session, deployment_id)
    session.expire_all()
    dep = session.get(Deployment, deployment_id)
    assert dep is not None
    return _object(dep, _gpus(session).get(dep.id, []))
