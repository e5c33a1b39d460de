"""Rate limits, the one home of them: jobs a minute per tenant (POST /v1/jobs) and inference
requests and tokens a minute per API key (/v1/chat/completions, /v1/completions). Over a
limit is a 429 with ``Retry-After`` (``RetryLater``; OpenAI's SDKs retry it).

Both count in the database, which every API process shares in every setup (SQLite under
``ftune up``, PostgreSQL with any number of ``ftune api`` processes): a limit is the
service's, not one process's. Redis is not used: the embedded stack has none.

* Jobs: the tenant's job rows of the last minute are the count (nothing else to keep).
* Inference: a counter row per key and minute (``RateWindow``), taken by a guarded
  ``UPDATE ... WHERE requests <= limit - n``: two processes never both take the last
  requests of a minute. A fixed window (the clock's minute), so a key may send up to twice
  its limit across a minute's boundary.
  Each API process takes requests from the row in *leases* (``InferenceLimiter``): up to
  1/32 of the limit at once (at most 32), used from memory, so a busy key costs one write
  per lease instead of one before each request's first token (bench/serving.py measures
  the router with the limits on and off). A limit
  under 64 a minute is a lease of one: counted exactly, request by request. A lease used
  below half is topped up by the next lease in the background (``wants_more``,
  ``top_up``), so a key in steady use never waits for the row before its first token.
  What a lease costs: the requests a process leased but did not use count as used, so with
  P processes a key may be refused up to P x (1.5 x lease - 1) requests early in a minute
  (under 5 % of the limit a process, at most 47), never let through past its limit.
  Tokens are known only once the engine answered: they are added to the window the request
  was admitted in, and a key whose window has used its tokens waits for the next one. A
  process sends its tokens to the row with its next lease, or at once when they pass 1/32
  of the limit or a second has gone by: another process sees them that late at most.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import RetryLater
from core.db.models import Job, RateWindow, Tenant, utcnow
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


LEASE_SHARE = 32  # a lease is at most 1/LEASE_SHARE of a limit ...
LEASE_MAX = 32  # ... and at most this many requests
TOKEN_SYNC_SECONDS = 1.0


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


def lease_size(rpm: int | None) -> int:
    """Requests one lease takes from a key's minute (1: every request counted in the row)."""
    if rpm is None:  # only tokens are limited: requests are counted, never refused
        return LEASE_MAX
    return max(1, min(LEASE_MAX, rpm // LEASE_SHARE))


class NeedsRow:
    """InferenceLimiter.admit_held's answer when only the database can decide."""


NEEDS_ROW = NeedsRow()


@dataclass
class _Lease:
    """What this process holds of one key's minute."""

    window: int
    requests: int  # leased from the row, not used yet
    tokens: int  # the window's tokens as this process knows them (the row's + its own)
    unsent: int = 0  # this process's tokens not yet added to the row
    synced: float = 0.0  # time.monotonic() of the last exchange with the row
    topping_up: bool = False  # a top_up of it is under way


class InferenceLimiter:
    """One per API process (``app.state.inference_limiter``): admits inference requests
    against the key's minute row through leases (the module's docstring says why)."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()

    def admit_held(self, subject: str, settings: Settings, now: datetime | None = None
                   ) -> Admitted | None | NeedsRow:
        """``admit`` as far as this process's lease decides it, without the database:
        Admitted (or RetryLater) from the lease, None when no limit is set, NEEDS_ROW when
        the key's minute row must be asked (no lease left). The API calls it on its event
        loop, so a request with a lease left takes no trip to a thread."""
        rpm = settings.inference_requests_per_minute_per_key or None  # 0: no limit
        tpm = settings.inference_tokens_per_minute_per_key or None
        if rpm is None and tpm is None:
            return None
        now = now or utcnow()
        window = window_of(now)
        with self._lock:
            lease = self._leases.get(subject)
            if lease is not None and lease.window != window:
                lease = None  # an older minute's: its counts limit nothing any more
                self._leases.pop(subject, None)
            if lease is not None and tpm is not None and lease.tokens >= tpm:
                raise _refused(window, now, f"{tpm} tokens")
            if lease is not None and lease.requests > 0:
                lease.requests -= 1
                return Admitted(subject, window)
        return NEEDS_ROW

    def wants_more(self, subject: str, settings: Settings) -> bool:
        """True, once, when the key's lease is used below half: the caller then runs
        ``top_up`` in the background. Never for a lease of one (counted exactly)."""
        size = lease_size(settings.inference_requests_per_minute_per_key or None)
        if size <= 1:
            return False
        with self._lock:
            lease = self._leases.get(subject)
            if lease is None or lease.topping_up or lease.requests * 2 >= size:
                return False
            lease.topping_up = True
            return True

    def top_up(self, session: Session, subject: str, settings: Settings,
               now: datetime | None = None) -> None:
        """The next lease of the key's minute, added to what is left of this one. A minute
        with nothing left refuses no one here: the request that finds the lease empty asks
        the row and gets its 429."""
        try:
            self._lease(session, subject, settings, now or utcnow(), take_one=False)
        except RetryLater:
            pass
        finally:
            with self._lock:
                lease = self._leases.get(subject)
                if lease is not None:
                    lease.topping_up = False

    def admit(self, session: Session, subject: str, settings: Settings,
              now: datetime | None = None) -> Admitted | None:
        """Count one inference request for ``subject``, or raise RetryLater (429) when its
        minute has had ``inference_requests_per_minute_per_key`` requests or used
        ``inference_tokens_per_minute_per_key`` tokens. None when neither is set (0)."""
        now = now or utcnow()
        from_lease = self.admit_held(subject, settings, now)
        if not isinstance(from_lease, NeedsRow):
            return from_lease
        return self._lease(session, subject, settings, now, take_one=True)

    def _lease(self, session: Session, subject: str, settings: Settings, now: datetime, *,
               take_one: bool) -> Admitted:
        """A lease from the key's minute row, into this process's; one of its requests is
        the caller's when ``take_one``."""
        rpm = settings.inference_requests_per_minute_per_key or None  # 0: no limit
        tpm = settings.inference_tokens_per_minute_per_key or None
        window = window_of(now)
        with self._lock:
            lease = self._leases.get(subject)
            unsent = lease.unsent if lease is not None and lease.window == window else 0
        if session.get_bind().dialect.name == "sqlite":
            # One writer at a time in this process: SQLite takes one writer anyway, and
            # concurrent requests that contend for its lock back off in its busy handler's
            # sleeps (tens of ms each); queued here, each waits only for the writes ahead.
            with _sqlite_writes:
                taken, tokens = _take(session, subject, window, now, rpm, tpm,
                                      lease_size(rpm), unsent)
        else:
            taken, tokens = _take(session, subject, window, now, rpm, tpm,
                                  lease_size(rpm), unsent)
        with self._lock:
            held = self._leases.get(subject)
            if held is None or held.window != window:
                held = self._leases[subject] = _Lease(window, 0, 0)
            held.unsent -= unsent  # sent with the lease (tokens added meanwhile stay)
            held.requests += taken - 1 if take_one else taken  # one may be this request's
            held.tokens = tokens + held.unsent
            held.synced = time.monotonic()
            if len(self._leases) > 100_000:  # keys of minutes long gone
                self._leases = {k: v for k, v in self._leases.items() if v.window == window}
        return Admitted(subject, window)

    def add_tokens(self, session: Session, admitted: Admitted, tokens: int,
                   settings: Settings) -> None:
        """The answer's tokens, into the window its request was admitted in: kept in memory
        and sent to the row when they pass 1/32 of the limit or a second has gone by."""
        tpm = settings.inference_tokens_per_minute_per_key or None
        if tokens <= 0 or tpm is None:
            return
        with self._lock:
            lease = self._leases.get(admitted.subject)
            if lease is None or lease.window != admitted.window:
                return  # its minute is over: its tokens limit nothing any more
            lease.tokens += tokens
            lease.unsent += tokens
            due = (lease.unsent >= max(1, tpm // LEASE_SHARE)
                   or time.monotonic() - lease.synced >= TOKEN_SYNC_SECONDS)
            unsent = lease.unsent if due else 0
        if not unsent:
            return
        session.execute(update(RateWindow).where(RateWindow.subject == admitted.subject,
                                                 RateWindow.window == admitted.window)
                        .values(tokens=RateWindow.tokens + unsent)
                        .execution_options(synchronize_session=False))
        session.commit()
        with self._lock:
            lease = self._leases.get(admitted.subject)
            if lease is not None and lease.window == admitted.window:
                lease.unsent -= unsent
                lease.synced = time.monotonic()


_sqlite_writes = threading.Lock()


def _refused(window: int, now: datetime, what: str) -> RetryLater:
    retry = (window + 1) * WINDOW_SECONDS - now.timestamp()
    return RetryLater(f"this API key has used its {what} a minute of inference; retry later",
                      retry_after=math.ceil(retry))


def _take(session: Session, subject: str, window: int, now: datetime, rpm: int | None,
          tpm: int | None, size: int, unsent: int) -> tuple[int, int]:
    """Take up to ``size`` requests of the key's minute row (committed), sending this
    process's ``unsent`` tokens with them: (requests taken, the row's tokens after). A lease
    the row cannot give whole is taken one request at a time (the minute's last requests
    are counted exactly). Raises RetryLater when the row has nothing left."""
    for _ in range(3):
        for n in dict.fromkeys((size, 1)):  # the lease, else the last request
            conditions = [RateWindow.subject == subject, RateWindow.window == window]
            if rpm is not None:
                conditions.append(RateWindow.requests <= rpm - n)
            if tpm is not None:
                conditions.append(RateWindow.tokens + unsent < tpm)
            row = session.execute(
                update(RateWindow).where(*conditions)
                .values(requests=RateWindow.requests + n, tokens=RateWindow.tokens + unsent)
                .returning(RateWindow.tokens)
                .execution_options(synchronize_session=False)).first()
            if row is not None:
                session.commit()
                return n, int(row[0])
        found = session.get(RateWindow, (subject, window), populate_existing=True)
        if found is not None:
            session.rollback()
            spent = rpm is not None and found.requests >= rpm
            raise _refused(window, now, f"{rpm} requests" if spent else f"{tpm} tokens")
        # The key's first request this minute: its row, and its older rows gone.
        session.execute(delete(RateWindow).where(RateWindow.subject == subject,
                                                 RateWindow.window < window)
                        .execution_options(synchronize_session=False))
        size = min(size, rpm) if rpm is not None else size
        session.add(RateWindow(subject=subject, window=window, requests=size, tokens=0))
        try:
            session.commit()
            return size, 0
        except IntegrityError:  # another process made it meanwhile: count in it
            session.rollback()
    raise RetryLater("inference rate limit: could not count the request; retry",
                     retry_after=1)
