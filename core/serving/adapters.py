"""Adapters loaded into a deployment's engine: loaded at first use (vLLM's
``/v1/load_lora_adapter``), the least recently used unloaded once more than the operator's
``serving_max_loras`` are in (``/v1/unload_lora_adapter``). The rows say what each engine
generation holds, for every API process and worker alike."""

from __future__ import annotations

import logging
import threading
import time

import httpx
from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.models import utcnow
from core.infra.errors import InvalidRequest
from core.infra.settings import Settings
from core.serving.deployments import ServingUnavailable
from core.serving.resolve import Adapter
from core.serving.tables import Deployment, DeploymentAdapter

log = logging.getLogger(__name__)
LOAD_TIMEOUT = 120.0
# A hit refreshes its row's last use at most this often per process (each write would also
# wake every API process's read cache, api/notices.py).
TOUCH_EVERY_SECONDS = 1.0
_touched: dict[tuple[str, str], float] = {}
_touched_lock = threading.Lock()


def engine_headers(dep: Deployment) -> dict[str, str]:
    return {"Authorization": f"Bearer {dep.engine_key}"} if dep.engine_key else {}


def ensure_loaded(session: Session, dep: Deployment, adapter: Adapter,
                  settings: Settings) -> None:
    """Load ``adapter`` into ``dep``'s engine unless its current generation has it."""
    row = session.get(DeploymentAdapter, (dep.id, adapter.engine_name))
    if row is not None and row.generation == dep.generation:
        _touch(session, dep.id, adapter.engine_name)
        return
    _engine_call(dep, "/v1/load_lora_adapter",
                 {"lora_name": adapter.engine_name, "lora_path": str(adapter.path)})
    now = utcnow()
    if row is not None:
        row.generation, row.path, row.loaded_at, row.last_used_at = (dep.generation,
                                                                     str(adapter.path), now, now)
    else:
        session.add(DeploymentAdapter(deployment_id=dep.id, name=adapter.engine_name,
                                      generation=dep.generation, path=str(adapter.path),
                                      loaded_at=now, last_used_at=now))
    try:
        session.commit()
    except IntegrityError:  # loaded by another process at the same time
        session.rollback()
    evict(session, dep, settings.serving_max_loras, keep=adapter.engine_name)


def evict(session: Session, dep: Deployment, max_loras: int, *, keep: str | None = None) -> list[str]:
    """Unload the least recently used adapters past ``max_loras``; forget rows of older
    engine generations (that engine is gone). Returns the names unloaded."""
    session.execute(delete(DeploymentAdapter).where(
        DeploymentAdapter.deployment_id == dep.id,
        DeploymentAdapter.generation != dep.generation))
    session.commit()
    rows = list(session.scalars(select(DeploymentAdapter).where(
        DeploymentAdapter.deployment_id == dep.id)
        .order_by(DeploymentAdapter.last_used_at.desc())))
    unloaded = []
    for row in [r for r in rows if r.name != keep][max(0, max_loras - 1):] \
            if len(rows) > max_loras else []:
        unload(session, dep, row.name)
        unloaded.append(row.name)
    return unloaded


def unload(session: Session, dep: Deployment, name: str) -> None:
    try:
        _engine_call(dep, "/v1/unload_lora_adapter", {"lora_name": name})
    except (ServingUnavailable, InvalidRequest):
        log.warning("could not unload adapter %s from %s", name, dep.id)  # gone with its engine
    session.execute(delete(DeploymentAdapter).where(DeploymentAdapter.deployment_id == dep.id,
                                                    DeploymentAdapter.name == name))
    session.commit()


def _engine_call(dep: Deployment, path: str, body: dict[str, str]) -> None:
    try:
        r = httpx.post(f"{dep.url}{path}", json=body, headers=engine_headers(dep),
                       timeout=LOAD_TIMEOUT)
    except httpx.HTTPError as e:
        raise ServingUnavailable(f"the engine of deployment {dep.id} did not answer: {e}",
                                 code="engine_unavailable") from None
    if r.status_code == 200 or "already been loaded" in r.text:
        return
    if r.status_code in (400, 404):
        message = r.json().get("error", {}).get("message", r.text) if r.headers.get(
            "content-type", "").startswith("application/json") else r.text
        raise InvalidRequest(f"the engine refused the adapter: {message}", param="model",
                             code="invalid_model")
    raise ServingUnavailable(f"the engine of deployment {dep.id} answered {r.status_code} "
                             f"to {path}: {r.text[:500]}")


def _touch(session: Session, dep_id: str, name: str) -> None:
    key, now = (dep_id, name), time.monotonic()
    with _touched_lock:
        if now - _touched.get(key, 0.0) < TOUCH_EVERY_SECONDS:
            return
        _touched[key] = now
    session.execute(update(DeploymentAdapter).where(DeploymentAdapter.deployment_id == dep_id,
                                                    DeploymentAdapter.name == name)
                    .values(last_used_at=utcnow()))
    session.commit()
