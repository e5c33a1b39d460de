"""Deployments placed on GPUs through the database and real claims (worker/serve/claim.py,
worker/run/claim.py ``claim_next``): a deployment's GPU is a gpu_allocations row that no
training job is given, freed when it stops; an idle deployment yields to a job of higher
priority; one that fits nowhere says why. Workers registered with GPU inventories; no GPU
or engine needed (the pure rules: tests/core/jobs/test_serving_plan.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import delete, select, update

from core.db.models import GpuAllocation, Job, JobStatus, Tenant, Worker, utcnow
from core.db.session import session_scope
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.jobs.serving_plan import SERVING_CAPABILITY
from core.serving.tables import Deployment, DeploymentState
from tests.utils.worker import WorkerEnv
from worker.run.claim import claim_next, holder
from worker.serve.claim import claim_deployment, free_gpus
from worker.upkeep.registry import Inventory, register

GPU_MB = 81559


@pytest.fixture(scope="module")
def own_pg() -> Iterator[str]:
    from testkit.pg import migrated_database

    with migrated_database() as url:
        yield url


@pytest.fixture
def settings(tmp_path: Path, own_pg: str,
             configure: Callable[..., WorkerEnv]) -> Iterator[Settings]:
    yield configure(tmp_path, own_pg).settings
    with session_scope() as s:
        for table in (GpuAllocation, Deployment, Job, Tenant, Worker):
            s.execute(delete(table))


def add_gpu_worker(wid: str, gpus: int) -> None:
    inv = Inventory("host", [{"index": i, "name": "H100", "memory_mb": GPU_MB}
                             for i in range(gpus)], 8,
                    {"cuda": True, "bf16": True, SERVING_CAPABILITY: True}, gpus)
    with session_scope() as s:
        register(s, wid, inv)


def add_job(gpus: int = 1, *, priority: int = 0) -> str:
    dist = {"strategy": "ddp", "num_processes": gpus} if gpus > 1 else {}
    body = {"name": "fake:succeed", "model": {"name_or_path": "/m"},
            "dataset": {"path": "/d.jsonl"}, "priority": priority, "distributed": dist}
    with session_scope() as s:
        tenant = Tenant(name=f"acme-{priority}-{gpus}")
        s.add(tenant)
        s.flush()
        job = Job(tenant_id=tenant.id, name="fake:succeed", spec=body, priority=priority,
                  status=JobStatus.queued, queued_at=utcnow())
        s.add(job)
        s.flush()
        return job.id


def ask_deployment(location: Path, key: str = "base:m") -> str:
    location.mkdir(exist_ok=True)
    with session_scope() as s:
        dep = Deployment(key=key, kind="base", location=str(location),
                         state=DeploymentState.requested)
        s.add(dep)
        s.flush()
        return dep.id


def held() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with session_scope() as s:
        for a in s.scalars(select(GpuAllocation).order_by(GpuAllocation.gpu_index)):
            out.setdefault(a.job_id or f"{a.deployment_id}", []).append(a.gpu_index)
    return out


def test_a_deployments_gpu_is_not_given_to_a_training_job_until_it_stops(
        settings: Settings, tmp_path: Path) -> None:
    add_gpu_worker("w1", 2)
    dep_id = ask_deployment(tmp_path / "m")
    placed = claim_deployment(settings, "w1", gpu=True, running=[])
    assert placed is not None and (placed.deployment_id, placed.gpu_ids) == (dep_id, (0,))
    assert placed.memory_mb == 1 + 1024  # no weights on disk; the KV cache's GiB
    big, small = add_job(2), add_job(1)
    claim = claim_next(settings, "w1")
    assert claim is not None and (claim.job_id, claim.gpu_ids) == (small, (1,))
    assert held() == {dep_id: [0], small: [1]}
    with session_scope() as s:  # it stops (the supervisor's move): its GPU comes free
        s.execute(update(Deployment).where(Deployment.id == dep_id)
                  .values(state=DeploymentState.stopped))
        free_gpus(s, dep_id)
    with session_scope() as s:
        assert jobstate.finish(s, small, holder(claim), previous=JobStatus.running,
                               to=JobStatus.succeeded, now=utcnow())
    both = claim_next(settings, "w1")
    assert both is not None and (both.job_id, both.gpu_ids) == (big, (0, 1))


def test_an_idle_deployment_yields_to_a_higher_priority_job(
        settings: Settings, tmp_path: Path) -> None:
    add_gpu_worker("w1", 1)
    dep_id = ask_deployment(tmp_path / "m")
    assert claim_deployment(settings, "w1", gpu=True, running=[]) is not None
    idle_since = utcnow() - timedelta(seconds=settings.serving_yield_idle_seconds + 5)
    with session_scope() as s:
        s.execute(update(Deployment).where(Deployment.id == dep_id)
                  .values(state=DeploymentState.ready, last_used_at=idle_since))
    add_job(1, priority=0)
    assert claim_next(settings, "w1") is None  # a job of serving priority waits...
    with session_scope() as s:
        assert s.get(Deployment, dep_id).state == DeploymentState.ready  # type: ignore[union-attr]
    urgent = add_job(1, priority=5)
    assert claim_next(settings, "w1") is None  # ...a higher one has it stopped
    with session_scope() as s:
        assert s.get(Deployment, dep_id).state == DeploymentState.stopping  # type: ignore[union-attr]
        free_gpus(s, dep_id)  # the supervisor stopped the engine
    claim = claim_next(settings, "w1")
    assert claim is not None and claim.job_id == urgent


def test_a_deployment_that_fits_nowhere_says_why(settings: Settings, tmp_path: Path) -> None:
    add_gpu_worker("w1", 1)
    add_job(1, priority=5)
    dep_id = ask_deployment(tmp_path / "m")
    assert claim_deployment(settings, "w1", gpu=True, running=[]) is None
    with session_scope() as s:
        dep = s.get(Deployment, dep_id)
        assert dep is not None and dep.state == DeploymentState.requested
        assert dep.waiting is not None and dep.waiting.startswith("GPUs: needs 1 (1,025 MiB")


def test_the_reconciler_frees_the_gpus_of_a_deployment_taken_over_from_a_dead_worker(
        settings: Settings, tmp_path: Path) -> None:
    from worker.upkeep.reconciler import reconcile

    add_gpu_worker("w1", 1)
    dep_id = ask_deployment(tmp_path / "m")
    assert claim_deployment(settings, "w1", gpu=True, running=[]) is not None
    with session_scope() as s:  # what a request does once its worker fell silent
        s.execute(update(Deployment).where(Deployment.id == dep_id)
                  .values(state=DeploymentState.requested, worker_id=None))
    assert held() == {dep_id: [0]}
    reconcile()
    assert held() == {}
