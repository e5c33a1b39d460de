"""/v1/deployments: the engine servers, for admin keys only (a tenant key gets 403)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import AdminTenant, SessionDep
from api.errors import error_responses
from api.schemas import Page
from api.services import deployments
from api.services.deployments import DeploymentObject

router = APIRouter(prefix="/v1/deployments", tags=["deployments"],
                   responses=error_responses(401, 403))

DeploymentId = Annotated[str, Path(max_length=40)]


@router.get("", response_model=Page[DeploymentObject])
def list_deployments(session: SessionDep, _: AdminTenant) -> Page[DeploymentObject]:
    """Every deployment: its model, state, worker and GPUs, and why a requested one waits."""
    return Page(data=deployments.list_deployments(session))


@router.post("/{deployment_id}/stop", response_model=DeploymentObject,
             responses=error_responses(404))
def stop(deployment_id: DeploymentId, session: SessionDep, _: AdminTenant) -> DeploymentObject:
    """Stop it now: its worker stops the engine's process tree and frees its GPUs; the next
    request for its model starts it again."""
    return deployments.stop_deployment(session, deployment_id)
