"""``open_model``: the one call a client of a deployment makes (the API's router, an eval
run in a worker): resolve the tenant's model name, make sure its deployment runs and its
adapter is loaded, and say where to send OpenAI requests and under which model name."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from core.db.models import Tenant
from core.infra.settings import Settings
from core.serving import adapters, deployments
from core.serving.deployments import ServingUnavailable
from core.serving.resolve import Resolved, resolve
from core.serving.tables import Deployment, DeploymentState

POLL_SECONDS = 0.2
TOUCH_EVERY_SECONDS = 1.0
_touched: dict[str, float] = {}
_lock = threading.Lock()


@dataclass(frozen=True)
class EngineTarget:
    """Where to send OpenAI requests for ``model``: ``base_url`` (ends in /v1) with
    ``headers`` (the engine's bearer token), ``engine_model`` in the body's ``model``."""

    model: str  # the name the caller used: put it back in what the engine returns
    engine_model: str
    base_url: str
    api_key: str
    deployment_id: str
    job_id: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


def open_model(sessions: Callable[[], Session], tenant: Tenant, model: str,
               settings: Settings, *, wait_seconds: float | None = None,
               evaluating: str | None = None) -> EngineTarget:
    """Blocking (call it from a thread in async code). Raises ModelNotFound (404) for a
    name that is not the tenant's, ServingUnavailable (503, Retry-After) when no engine is
    installed, the deployment failed, or it is still starting after ``wait_seconds``
    (default: settings.serving_start_wait_seconds). ``evaluating``: the job whose
    evaluation asks (core/evals/job_evaluation.py), served before it succeeded."""
    wait = settings.serving_start_wait_seconds if wait_seconds is None else wait_seconds
    with sessions() as session:
        target = resolve(session, tenant, model, settings, evaluating=evaluating)
        dep = _wait_ready(session, target, settings, wait)
        if target.adapter is not None:
            adapters.ensure_loaded(session, dep, target.adapter, settings)
        _touch(session, dep.id)
        return _target(target, dep)


def _wait_ready(session: Session, target: Resolved, settings: Settings,
                wait: float) -> Deployment:
    """The deployment of ``target``, asked for; again once a stop of it meanwhile (the
    operator's, idle time) has ended."""
    dep = deployments.request(session, target, settings)
    deadline = time.monotonic() + wait
    while True:
        if dep.state == DeploymentState.stopped:
            dep = deployments.request(session, target, settings)
        if dep.state == DeploymentState.ready and dep.url:
            return dep
        if dep.state == DeploymentState.failed:
            raise ServingUnavailable(f"the model's deployment failed: {dep.error}",
                                     code="deployment_failed", retry_after=30)
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_SECONDS)
        session.refresh(dep)
    why = f": it waits for room ({dep.waiting})" if dep.waiting else \
        " (an engine takes ~30 s or more to start)"
    raise ServingUnavailable(f"the model's deployment is {dep.state}{why}; retry shortly",
                             code="deployment_starting", retry_after=5)


def _touch(session: Session, dep_id: str) -> None:
    """Scale to zero reads the deployment's last use; written at most once a second."""
    now = time.monotonic()
    with _lock:
        if now - _touched.get(dep_id, 0.0) < TOUCH_EVERY_SECONDS:
            return
        _touched[dep_id] = now
    deployments.touch(session, dep_id)


def _target(target: Resolved, dep: Deployment) -> EngineTarget:
    assert dep.url is not None
    return EngineTarget(model=target.model, engine_model=target.engine_model,
                        base_url=f"{dep.url}/v1", api_key=dep.engine_key or "",
                        deployment_id=dep.id, job_id=target.job_id)
