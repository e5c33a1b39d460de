"""/v1/usage: what the tenant's jobs used, by day."""

from __future__ import annotations

from datetime import date
from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.schemas import UsageReport
from api.services import usage

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=error_responses(401))


@router.get("", response_model=UsageReport, responses=error_responses(422))
def get_usage(
    session: SessionDep,
    tenant: CurrentTenant,
    settings: SettingsDep,
    start: Annotated[
        date | None, Query(alias="from", description="First UTC day, YYYY-MM-DD (inclusive).")
    ] = None,
    end: Annotated[
        date | None, Query(alias="to", description="Last UTC day, YYYY-MM-DD (inclusive).")
    ] = None,
) -> UsageReport:
    """Tokens, GPU-seconds, attempts and cost of the tenant's job attempts, by the UTC day
    they ended (default: the last 30 days)."""
    return usage.usage_report(session, tenant, start, end, settings)
