"""Inference usage: tokens per tenant, model name (as the tenant wrote it) and UTC day."""

from __future__ import annotations

from datetime import date

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.models import utcnow
from core.db.session import execute_rowcount
from core.serving.tables import InferenceUsage

MAX_MODEL_NAME = 256


def record(session: Session, tenant_id: str, model: str, prompt_tokens: int,
           completion_tokens: int) -> None:
    """Add one request's tokens (committed). Safe beside other processes doing the same."""
    day, model = utcnow().date().isoformat(), model[:MAX_MODEL_NAME]
    for _ in range(3):
        add = (update(InferenceUsage)
               .where(InferenceUsage.tenant_id == tenant_id, InferenceUsage.day == day,
                      InferenceUsage.model == model)
               .values(requests=InferenceUsage.requests + 1,
                       prompt_tokens=InferenceUsage.prompt_tokens + prompt_tokens,
                       completion_tokens=InferenceUsage.completion_tokens + completion_tokens))
        if execute_rowcount(session, add):
            session.commit()
            return
        session.add(InferenceUsage(tenant_id=tenant_id, day=day, model=model, requests=1,
                                   prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens))
        try:
            session.commit()
            return
        except IntegrityError:  # another process inserted the day's row: add to it
            session.rollback()


def by_day(session: Session, tenant_id: str, start: date, end: date) -> list[InferenceUsage]:
    return list(session.scalars(select(InferenceUsage).where(
        InferenceUsage.tenant_id == tenant_id, InferenceUsage.day >= start.isoformat(),
        InferenceUsage.day <= end.isoformat()).order_by(InferenceUsage.day, InferenceUsage.model)))
