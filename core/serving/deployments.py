"""Deployments as rows: asked for by requests (any process), run by one worker's serving
supervisor (worker/serve/). Every transition is a guarded UPDATE on the state it leaves, so
two processes never both start, stop or take over the same deployment."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.models import WORKER_GONE, Worker, utcnow
from core.db.session import execute_rowcount
from core.infra.errors import FtuneError
from core.infra.settings import Settings
from core.jobs.serving_plan import SERVING_CAPABILITY
from core.serving.engine import ENGINE_MAKE_TARGET
from core.serving.resolve import Resolved
from core.serving.tables import RUNNING, Deployment, DeploymentState


class ServingUnavailable(FtuneError):
    """503: nothing can serve the model now; ``retry_after`` seconds is worth a retry."""

    status_code = 503
    code = "engine_unavailable"

    def __init__(self, message: str, *, retry_after: int = 5, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.headers = {"Retry-After": str(retry_after)}


def live_engine_workers(session: Session, settings: Settings,
                        now: datetime | None = None) -> list[Worker]:
    now = now or utcnow()
    cutoff = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = session.scalars(select(Worker).where(Worker.heartbeat_at >= cutoff,
                                                Worker.state.not_in(WORKER_GONE)))
    return [w for w in rows if (w.capabilities or {}).get(SERVING_CAPABILITY)]


def request(session: Session, target: Resolved, settings: Settings) -> Deployment:
    """The deployment of ``target``, asked to run if it does not (committed)."""
    if not live_engine_workers(session, settings):
        raise ServingUnavailable(
            "no worker can run the inference engine: none is installed (run "
            f"`{ENGINE_MAKE_TARGET}` on a worker's machine, or set FTUNE_ENGINE_VENV) or no "
            "worker with one is up (`ftune doctor` says which)", retry_after=30)
    dep = session.scalar(select(Deployment).where(Deployment.key == target.deployment_key))
    if dep is None:
        dep = Deployment(key=target.deployment_key, kind=target.deployment_kind,
                         location=target.location, job_id=target.job_id
                         if target.deployment_kind == "full" else None,
                         keep_warm=target.keep_warm, state=DeploymentState.requested)
        session.add(dep)
        try:
            session.commit()
        except IntegrityError:  # another process asked first
            session.rollback()
            dep = session.scalars(select(Deployment).where(
                Deployment.key == target.deployment_key)).one()
        return dep
    if dep.state in (DeploymentState.stopped, DeploymentState.failed) or _abandoned(dep, settings):
        now = utcnow()
        moved = execute_rowcount(session,
            update(Deployment).where(Deployment.id == dep.id, Deployment.state == dep.state)
            .values(state=DeploymentState.requested, worker_id=None, url=None,
                    requested_at=now, last_used_at=now, keep_warm=target.keep_warm,
                    restarts=0, error=None if dep.state != DeploymentState.failed
                    else dep.error))
        session.commit()
        if moved:
            session.refresh(dep)
    return dep


def _abandoned(dep: Deployment, settings: Settings) -> bool:
    """Running (or stopping) by its row, but its worker stopped heart-beating for it."""
    if dep.state not in (*RUNNING, DeploymentState.stopping):
        return False
    beat = dep.heartbeat_at or dep.started_at or dep.requested_at
    return utcnow() - beat > timedelta(seconds=settings.heartbeat_timeout_seconds)


def touch(session: Session, deployment_id: str) -> None:
    session.execute(update(Deployment).where(Deployment.id == deployment_id)
                    .values(last_used_at=utcnow()))
    session.commit()


def stop(session: Session, deployment_id: str) -> bool:
    """Ask the worker running it to stop it (the operator, or a deleted full model)."""
    moved = execute_rowcount(session,
        update(Deployment).where(Deployment.id == deployment_id,
                                 Deployment.state.in_([*RUNNING]))
        .values(state=DeploymentState.stopping))
    requested = execute_rowcount(session,
        update(Deployment).where(Deployment.id == deployment_id,
                                 Deployment.state == DeploymentState.requested)
        .values(state=DeploymentState.stopped, stopped_at=utcnow()))
    session.commit()
    return bool(moved or requested)
