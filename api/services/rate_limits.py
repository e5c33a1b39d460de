"""Rate limits, the one home of them: jobs a minute per tenant (POST /v1/jobs) and inference
requests and tokens a minute per API key (/v1/chat/completions, /v1/completions). Over a
limit is a 429 with ``Retry-After`` (``RetryLater``; OpenAI's SDKs retry it).

Both count in the database, which every API process shares in every setup (SQLite under
``ftune up``, PostgreSQL with any number of ``ftune api`` processes): a limit is the
service's, not one process's. Redis is not used: the embedded stack has none.

* Jobs: the tenant's job rows of the last minute are the count (nothing else to keep).
* Inference: a counter row per key and minute (``RateWindow``), taken by a guarded
  ``UPDATE ... WHERE requests < limit``: two processes never both take the last request of
  a minute. A fixed window (the clock's minute), so a key may send up to twice its limit
  across a minute's boundary; the counts stay exact and the write is one small row.
  Tokens are known only once the engine answered: they are added to the window the request
  was admitted in, and a key whose window has used its tokens waits for the next one.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import RetryLater
from core.db.models import Job, RateWindow, Tenant, utcnow
from core.db.session import execute_rowcount
from core.infra.settings import Settings

JOB_WINDOW = timedelta(minutes=1)
WINDOW_SECONDS = 60


def check_job_rate(session: Session, tenant: Tenant, settings: Settings) -> None:
    """429 when the tenant created ``jobs_per_minute_per_tenant`` jobs in the last minute."""
    since = utcnow() - JOB_WINDOW
    count, oldest = session.execute(
        select(func.count(Job.id), func.min(Job.created_at)).where(
            Job.tenant_id == tenant.id, Job.created_at >= since
        )
    ).one()
    limit = settings.jobs_per_minute_per_tenant
    if count >= limit:
        retry = math.ceil((oldest - since).total_seconds()) if oldest is not None else 60
        raise RetryLater(f"more than {limit} jobs a minute; retry later", retry_after=retry)


@dataclass(frozen=True)
class Admitted:
    """An inference request let through: its tokens go to ``window`` once known."""

    subject: str
    window: int


def key_subject(key_hash: str) -> str:
    """What inference limits count by: the API key (its hash, as stored for the key)."""
    return "key:" + key_hash[:40]


def window_of(now: datetime) -> int:
    """The minute ``now`` falls in (minutes since the epoch)."""
    return int(now.timestamp()) // WINDOW_SECONDS


def admit_inference(session: Session, subject: str, settings: Settings,
                    now: datetime | None = None) -> Admitted | None:
    """Count one inference request for ``subject`` (committed), or raise RetryLater (429)
    when its minute has had ``inference_requests_per_minute_per_key`` requests or used
    ``inference_tokens_per_minute_per_key`` tokens. None when neither is set (0)."""
    rpm = settings.inference_requests_per_minute_per_key or None  # 0: no limit
    tpm = settings.inference_tokens_per_minute_per_key or None
    if rpm is None and tpm is None:
        return None
    if session.get_bind().dialect.name == "sqlite":
        # One writer at a time in this process: SQLite takes one writer anyway, and
        # concurrent requests that contend for its lock back off in its busy handler's
        # sleeps (tens of ms each); queued here, each waits only for the writes ahead.
        with _sqlite_writes:
            return _admit(session, subject, rpm, tpm, now or utcnow())
    return _admit(session, subject, rpm, tpm, now or utcnow())


_sqlite_writes = threading.Lock()


def _admit(session: Session, subject: str, rpm: int | None, tpm: int | None,
           now: datetime) -> Admitted:
    window = window_of(now)
    conditions = [RateWindow.subject == subject, RateWindow.window == window]
    if rpm is not None:
        conditions.append(RateWindow.requests < rpm)
    if tpm is not None:
        conditions.append(RateWindow.tokens < tpm)
    for _ in range(3):
        taken = execute_rowcount(session, update(RateWindow).where(*conditions)
                                 .values(requests=RateWindow.requests + 1)
                                 .execution_options(synchronize_session=False))
        if taken:
            session.commit()
            return Admitted(subject, window)
        row = session.get(RateWindow, (subject, window), populate_existing=True)
        if row is not None:
            session.rollback()
            retry = (window + 1) * WINDOW_SECONDS - now.timestamp()
            what = (f"{rpm} requests" if rpm is not None and row.requests >= rpm
                    else f"{tpm} tokens")
            raise RetryLater(f"this API key has used its {what} a minute of inference; "
                             "retry later", retry_after=math.ceil(retry))
        # The key's first request this minute: its row, and its older rows gone.
        session.execute(delete(RateWindow).where(RateWindow.subject == subject,
                                                 RateWindow.window < window)
                        .execution_options(synchronize_session=False))
        session.add(RateWindow(subject=subject, window=window, requests=1, tokens=0))
        try:
            session.commit()
            return Admitted(subject, window)
        except IntegrityError:  # another process made it meanwhile: count in it
            session.rollback()
    raise RetryLater("inference rate limit: could not count the request; retry",
                     retry_after=1)


def add_tokens(session: Session, admitted: Admitted, tokens: int) -> None:
    """The answer's tokens, into the window its request was admitted in (committed)."""
    if tokens <= 0:
        return
    session.execute(update(RateWindow).where(RateWindow.subject == admitted.subject,
                                             RateWindow.window == admitted.window)
                    .values(tokens=RateWindow.tokens + tokens)
                    .execution_options(synchronize_session=False))
    session.commit()
