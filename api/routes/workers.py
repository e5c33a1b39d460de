"""/v1/workers: the fleet, for admin keys only (a tenant key gets 403)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import AdminTenant, SessionDep
from api.errors import error_responses
from api.schemas import Page, WorkerObject
from api.services import workers

router = APIRouter(prefix="/v1/workers", tags=["workers"], responses=error_responses(401, 403))

WorkerId = Annotated[str, Path(max_length=200)]


@router.get("", response_model=Page[WorkerObject])
def list_workers(session: SessionDep, _: AdminTenant) -> Page[WorkerObject]:
    """Registered workers: GPUs and the job on each, CPU cores, capabilities, state."""
    return Page(data=workers.list_workers(session))


@router.post(
    "/{worker_id}/drain", response_model=WorkerObject, responses=error_responses(404, 409)
)
def drain(worker_id: WorkerId, session: SessionDep, _: AdminTenant) -> WorkerObject:
    """Take no new job on this worker; running jobs finish."""
    return workers.set_draining(session, worker_id, True)


@router.post(
    "/{worker_id}/undrain", response_model=WorkerObject, responses=error_responses(404, 409)
)
def undrain(worker_id: WorkerId, session: SessionDep, _: AdminTenant) -> WorkerObject:
    """Take new jobs again."""
    return workers.set_draining(session, worker_id, False)
