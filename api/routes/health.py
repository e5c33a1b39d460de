"""Liveness, readiness and Prometheus metrics (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.deps import SettingsDep, get_sessionmaker
from api.schemas import Readiness
from api.services.health import readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "The database or the broker is not."}},
)
def readyz(request: Request, settings: SettingsDep) -> JSONResponse:
    """The database answers and the broker is reachable; 503 names what is not."""
    checks = readiness(get_sessionmaker(request), settings)
    ok = all(v == "ok" for v in checks.values())
    body = Readiness(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    data = generate_latest(request.app.state.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
