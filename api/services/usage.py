"""Usage use-case: a tenant's usage by UTC day (core/jobs/usage.py does the accounting)."""

from __future__ import annotations

from datetime import date, timedelta

from sqlalchemy.orm import Session

from api.schemas import InferenceUsageDay, Usage, UsageDay, UsageReport
from core.db.models import Tenant, utcnow
from core.evals.usage import eval_usage_by_day
from core.infra.errors import InvalidRequest
from core.infra.settings import Settings
from core.jobs import usage
from core.serving import usage as inference_usage

DEFAULT_DAYS = 30


def usage_report(
    session: Session, tenant: Tenant, start: date | None, end: date | None, settings: Settings
) -> UsageReport:
    """Days ``start`` to ``end`` inclusive; by default the last 30 days up to today (UTC)."""
    end = end or utcnow().date()
    start = start or end - timedelta(days=DEFAULT_DAYS - 1)
    if start > end:
        raise InvalidRequest(f"from ({start}) is after to ({end})", param="from")
    if (end - start).days + 1 > usage.MAX_USAGE_DAYS:
        raise InvalidRequest(
            f"at most {usage.MAX_USAGE_DAYS} days at once", param="to"
        )
    price, currency = settings.price_per_gpu_hour, settings.price_currency
    days = usage.tenant_days(session, tenant.id, start, end)
    evals = eval_usage_by_day(session, tenant.id, start, end)
    total = usage.Totals()
    data = []
    for day, t in days:
        e = evals[day]
        data.append(UsageDay(date=day.isoformat(), jobs=t.job_count, eval_runs=e.runs,
                             eval_prompt_tokens=e.prompt_tokens,
                             eval_completion_tokens=e.completion_tokens,
                             eval_worker_seconds=round(e.worker_seconds, 3),
                             **t.as_dict(price, currency)))
        total.tokens += t.tokens
        total.loss_tokens += t.loss_tokens
        total.wall_seconds += t.wall_seconds
        total.gpu_seconds += t.gpu_seconds
        total.attempts += t.attempts
    return UsageReport(
        start=start.isoformat(),
        end=end.isoformat(),
        price_per_gpu_hour=price,
        data=data,
        total=Usage(**total.as_dict(price, currency)),
        inference=[InferenceUsageDay(date=u.day, model=u.model, requests=u.requests,
                                     prompt_tokens=u.prompt_tokens,
                                     completion_tokens=u.completion_tokens)
                   for u in inference_usage.by_day(session, tenant.id, start, end)],
    )
