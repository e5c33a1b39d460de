"""Inference usage: tokens per tenant, model name (as the tenant wrote it) and UTC day.

An API process adds its answers' usage to a ``UsageBuffer`` and writes it every
``FLUSH_SECONDS`` (api/main.py's lifespan), one row update per tenant, model and day that
had answers, instead of one write after every answer: on a router answering many short
streams, each write took the CPU from the streams still relaying (bench/serving.py). What
the buffer holds when the process is killed outright is lost (at most a second's usage);
a stop writes it first.
"""

from __future__ import annotations

import logging
import threading
from datetime import date

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.models import utcnow
from core.db.session import execute_rowcount
from core.serving.tables import InferenceUsage

log = logging.getLogger("ftune.serving")
MAX_MODEL_NAME = 256
FLUSH_SECONDS = 1.0


def record(session: Session, tenant_id: str, model: str, prompt_tokens: int,
           completion_tokens: int, *, requests: int = 1, day: str | None = None) -> None:
    """Add ``requests`` answers' tokens to the day's row (committed). Safe beside other
    processes doing the same."""
    day, model = day or utcnow().date().isoformat(), model[:MAX_MODEL_NAME]
    for _ in range(3):
        add = (update(InferenceUsage)
               .where(InferenceUsage.tenant_id == tenant_id, InferenceUsage.day == day,
                      InferenceUsage.model == model)
               .values(requests=InferenceUsage.requests + requests,
                       prompt_tokens=InferenceUsage.prompt_tokens + prompt_tokens,
                       completion_tokens=InferenceUsage.completion_tokens + completion_tokens))
        if execute_rowcount(session, add):
            session.commit()
            return
        session.add(InferenceUsage(tenant_id=tenant_id, day=day, model=model, requests=requests,
                                   prompt_tokens=prompt_tokens,
                                   completion_tokens=completion_tokens))
        try:
            session.commit()
            return
        except IntegrityError:  # another process inserted the day's row: add to it
            session.rollback()


class UsageBuffer:
    """One per API process: answers' usage summed in memory until ``flush`` writes it."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str, str], list[int]] = {}  # -> requests, prompt, completion
        self._lock = threading.Lock()

    def add(self, tenant_id: str, model: str, prompt_tokens: int, completion_tokens: int,
            requests: int = 1, day: str | None = None) -> None:
        key = (tenant_id, day or utcnow().date().isoformat(), model[:MAX_MODEL_NAME])
        with self._lock:
            counts = self._pending.setdefault(key, [0, 0, 0])
            counts[0] += requests
            counts[1] += prompt_tokens
            counts[2] += completion_tokens

    def __bool__(self) -> bool:
        return bool(self._pending)

    def flush(self, session: Session) -> None:
        """Write what was added since the last flush. A row that cannot be written goes
        back into the buffer for the next flush (and the error to the log): usage is not
        dropped because the database was busy once."""
        with self._lock:
            pending, self._pending = self._pending, {}
        rows = list(pending.items())
        for i, ((tenant_id, day, model), (requests, prompt, completion)) in enumerate(rows):
            try:
                record(session, tenant_id, model, prompt, completion, requests=requests, day=day)
            except Exception:
                session.rollback()
                log.exception("could not write inference usage; kept for the next flush")
                for (t, d, m), (n, p, c) in rows[i:]:
                    self.add(t, m, p, c, requests=n, day=d)
                return


def by_day(session: Session, tenant_id: str, start: date, end: date) -> list[InferenceUsage]:
    return list(session.scalars(select(InferenceUsage).where(
        InferenceUsage.tenant_id == tenant_id, InferenceUsage.day >= start.isoformat(),
        InferenceUsage.day <= end.isoformat()).order_by(InferenceUsage.day, InferenceUsage.model)))
