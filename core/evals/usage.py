"""What a tenant's eval runs used, by the UTC day they ended: runs, the tokens their models
generated and read (the engine's own usage, summed per item), and the seconds a worker held
them (claim to end, over all attempts: a resumed run counts the time of its first worker up
to its last heartbeat through started_at -> finished_at)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import EvalRun


@dataclass
class EvalDay:
    runs: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    worker_seconds: float = 0.0


def eval_usage_by_day(session: Session, tenant_id: str, first: date,
                      last: date) -> dict[date, EvalDay]:
    start = datetime(first.year, first.month, first.day, tzinfo=UTC)
    end = datetime(last.year, last.month, last.day, tzinfo=UTC) + timedelta(days=1)
    days = {first + timedelta(days=i): EvalDay() for i in range((last - first).days + 1)}
    rows = session.execute(
        select(EvalRun.finished_at, EvalRun.started_at, EvalRun.per_model_usage)
        .where(EvalRun.tenant_id == tenant_id, EvalRun.finished_at >= start,
               EvalRun.finished_at < end))
    for finished, started, per_model in rows:
        d = days.get(finished.astimezone(UTC).date())
        if d is None:
            continue
        d.runs += 1
        for u in per_model or []:
            d.prompt_tokens += int(u.get("prompt_tokens", 0))
            d.completion_tokens += int(u.get("completion_tokens", 0))
        if started is not None:
            d.worker_seconds += max((finished - started).total_seconds(), 0.0)
    return days
