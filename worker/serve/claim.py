"""A worker's claim of a requested deployment, and the GPUs it frees. On a GPU worker the
claim is a scheduling decision like a job's (core/jobs/serving_plan.py): under the same
decision lock, on the same fleet state, its GPUs written as gpu_allocations rows whose
primary key no job's claim can insert again. On a CPU worker it is today's serving budget
(``serving_slots``, ``serving_memory_mb``). Either way the row moves requested -> starting
by a guarded UPDATE, and the requested deployments that stay say why (``waiting``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from core.db.models import GpuAllocation, utcnow
from core.db.session import execute_rowcount, session_scope
from core.infra.settings import Settings
from core.jobs import queue_load, serving_plan
from core.jobs.serving_plan import DeploymentAsk, IdleDeployment
from core.serving.engine import deployment_memory_mb
from core.serving.tables import Deployment, DeploymentState

log = logging.getLogger(__name__)
ASKS_WINDOW = 20  # requested deployments a decision looks at, oldest first


@dataclass(frozen=True)
class ClaimedDeployment:
    deployment_id: str
    gpu_ids: tuple[int, ...]  # physical indices on this worker; () on a CPU worker
    memory_mb: int


def claim_deployment(settings: Settings, worker_id: str, *, gpu: bool,
                     running: list[str]) -> ClaimedDeployment | None:
    """The requested deployment this worker starts now (``running``: the deployments whose
    engines it runs), claimed, or None."""
    with session_scope() as s:
        if gpu:
            queue_load.lock_decisions(s)
        asks = [(d, DeploymentAsk(d.id, deployment_memory_mb(Path(d.location), settings),
                                  d.requested_at))
                for d in s.scalars(select(Deployment).where(
                    Deployment.state == DeploymentState.requested)
                    .order_by(Deployment.requested_at).limit(ASKS_WINDOW))]
        if not asks:
            return None
        if gpu:
            now = utcnow()
            state = queue_load.load_state(s, settings, now)
            placed, reasons = serving_plan.decide(state, [a for _, a in asks], worker_id,
                                                  settings, now)
            gpu_ids = tuple(placed.gpu_ids) if placed is not None else ()
            chosen = placed.deployment_id if placed is not None else None
        else:
            chosen, gpu_ids, reasons = _within_budget(s, settings, [a for _, a in asks],
                                                      running)
        _say_why(s, {d.id: d for d, _ in asks}, reasons)
        if chosen is None:
            return None
        need = next(a.memory_mb for _, a in asks if a.id == chosen)
        moved = execute_rowcount(s, update(Deployment).where(
            Deployment.id == chosen, Deployment.state == DeploymentState.requested)
            .values(state=DeploymentState.starting, worker_id=worker_id, memory_mb=need,
                    waiting=None).execution_options(synchronize_session=False))
        if not moved:
            return None  # another worker took it
        s.add_all(GpuAllocation(worker_id=worker_id, gpu_index=i, deployment_id=chosen,
                                allocated_at=utcnow()) for i in gpu_ids)
        s.flush()  # a GPU taken meanwhile fails here, and the claim rolls back with it
    return ClaimedDeployment(chosen, gpu_ids, need)


def _within_budget(s: Session, settings: Settings, asks: list[DeploymentAsk],
                   running: list[str]) -> tuple[str | None, tuple[int, ...], dict[str, str]]:
    held = sum(s.scalars(select(Deployment.memory_mb).where(Deployment.id.in_(running))))
    reasons: dict[str, str] = {}
    for a in asks:
        why = serving_plan.cpu_budget_refusal(a.memory_mb, held, settings.serving_memory_mb)
        if why is None:
            return a.id, (), reasons
        reasons[a.id] = why
    return None, (), reasons


def _say_why(s: Session, rows: dict[str, Deployment], reasons: dict[str, str]) -> None:
    """A requested deployment's ``waiting``, written when it changes (the API's 503 says it)."""
    for dep_id, why in reasons.items():
        if rows[dep_id].waiting != why:
            s.execute(update(Deployment).where(
                Deployment.id == dep_id, Deployment.state == DeploymentState.requested)
                .values(waiting=why).execution_options(synchronize_session=False))


def free_gpus(s: Session, deployment_id: str, *, worker_id: str | None = None) -> int:
    """A deployment's GPUs back to the fleet (it left starting/ready/stopping), or only
    those on ``worker_id`` (its engine there stopped; another worker took it over)."""
    gone = delete(GpuAllocation).where(GpuAllocation.deployment_id == deployment_id)
    if worker_id is not None:
        gone = gone.where(GpuAllocation.worker_id == worker_id)
    return execute_rowcount(s, gone.execution_options(synchronize_session=False))


def idle_deployments(s: Session, settings: Settings) -> list[IdleDeployment]:
    """Ready deployments on GPUs unused for ``serving_yield_idle_seconds``, not keep_warm:
    those that may yield to a queued job of higher priority (core/jobs/serving_plan.py)."""
    cutoff = utcnow() - timedelta(seconds=settings.serving_yield_idle_seconds)
    held: dict[tuple[str, str], int] = {}
    for dep_id, wid in s.execute(select(GpuAllocation.deployment_id, GpuAllocation.worker_id)
                                 .join(Deployment, Deployment.id == GpuAllocation.deployment_id)
                                 .where(Deployment.state == DeploymentState.ready,
                                        Deployment.keep_warm.is_(False),
                                        Deployment.last_used_at < cutoff)):
        held[(str(dep_id), wid)] = held.get((str(dep_id), wid), 0) + 1
    return [IdleDeployment(d, w, n) for (d, w), n in held.items()]


def stop_to_yield(s: Session, deployment_ids: list[str], settings: Settings) -> int:
    """Ask the workers running these idle deployments to stop them (guarded: still ready,
    still idle); the GPUs come free when they have."""
    cutoff = utcnow() - timedelta(seconds=settings.serving_yield_idle_seconds)
    moved = execute_rowcount(s, update(Deployment).where(
        Deployment.id.in_(deployment_ids), Deployment.state == DeploymentState.ready,
        Deployment.last_used_at < cutoff)
        .values(state=DeploymentState.stopping,
                error="stopped to give its GPUs to a queued job of higher priority")
        .execution_options(synchronize_session=False))
    if moved:
        log.info("idle deployments %s stop for a queued job of higher priority", deployment_ids)
    return moved
