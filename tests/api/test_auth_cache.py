"""Verified keys are remembered for ``api_key_cache_seconds``: a polling client costs no
database read or write for its key, a revoked key stops working within that bound, the key's
last use is still recorded, and read requests never write or commit."""

from __future__ import annotations

import secrets
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, event, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from api.main import create_app
from api.services.keys import KeyCache, create_api_key, hash_key, revoke_api_key
from core.db.models import ApiKey, Checkpoint, Job, JobEvent, Tenant, new_id, utcnow
from core.db.session import make_engine
from core.infra.settings import Settings
from testkit.wait import wait_until
from tests.utils.api import ServerThread, migrated_sqlite_url

TTL = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class StatementLog:
    """SQL the server ran, and its commits."""

    statements: list[str] = field(default_factory=list)
    commits: int = 0

    def clear(self) -> None:
        self.statements.clear()
        self.commits = 0

    def touching(self, table: str) -> list[str]:
        return [s for s in self.statements if table in s]

    def writes(self) -> list[str]:
        return [s for s in self.statements if s.split()[0].upper() in ("INSERT", "UPDATE", "DELETE")]


@dataclass
class CachedApi:
    url: str
    maker: sessionmaker[Session]
    clock: FakeClock
    sql: StatementLog
    key: str
    job_id: str
    app: Any

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=20
        )

    def new_key(self) -> str:
        with self.maker.begin() as s:
            return create_api_key(s, "cached-tenant", "tests")


def _record(engine: Engine, sql: StatementLog) -> None:
    @event.listens_for(engine, "before_cursor_execute")
    def _statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sql.statements.append(statement)

    @event.listens_for(engine, "commit")
    def _commit(conn: Any) -> None:
        sql.commits += 1


@pytest.fixture(scope="module")
def cached(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CachedApi]:
    db_url = migrated_sqlite_url(tmp_path_factory)
    engine = make_engine(db_url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    sql = StatementLog()
    _record(engine, sql)
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("ftune") / "data",
        DATABASE_URL=db_url,
        BROKER_URL="filesystem://",
        api_key_cache_seconds=TTL,
    )
    app = create_app(settings, enqueue=lambda job_id: None, session_factory=maker)
    clock = FakeClock()
    app.state.key_cache = KeyCache(ttl=TTL, clock=clock)
    with maker.begin() as s:
        key = create_api_key(s, "cached-tenant", "tests")
    with maker.begin() as s:
        tenant_id = s.scalars(select(Tenant.id).where(Tenant.name == "cached-tenant")).one()
        job_id = new_id("job")
        now = utcnow()
        s.execute(
            insert(Job).values(
                id=job_id, tenant_id=tenant_id, status="running", spec={}, created_at=now,
                queued_at=now, step=3, total_steps=10, attempt=1,
            )
        )  # fmt: skip
        s.execute(insert(JobEvent).values(job_id=job_id, type="progress", created_at=now))
        s.execute(insert(Checkpoint).values(job_id=job_id, step=2, path="/nowhere"))
    with ServerThread(app) as url:
        yield CachedApi(url, maker, clock, sql, key, job_id, app)
    engine.dispose()


READS = ["/v1/jobs", "/v1/jobs/{job}", "/v1/jobs/{job}/events", "/v1/jobs/{job}/checkpoints"]


def settle(cached: CachedApi) -> None:
    """Until the last-use writes started beside earlier requests are done."""
    wait_until(lambda: not getattr(cached.app.state, "key_use_writes", None), 10,
               "the last-use writes to finish", every=0.02)


def test_a_verified_key_costs_no_database_work(cached: CachedApi) -> None:
    with cached.client(cached.key) as c:
        assert c.get("/v1/jobs").status_code == 200
        settle(cached)
        cached.sql.clear()
        for path in READS:
            assert c.get(path.format(job=cached.job_id)).status_code == 200
    assert cached.sql.touching("api_keys") == []


def test_read_requests_neither_write_nor_commit(cached: CachedApi) -> None:
    with cached.client(cached.key) as c:
        c.get("/v1/jobs")  # the key verified (its last use may be written, once)
        settle(cached)
        cached.sql.clear()
        for path in READS:
            assert c.get(path.format(job=cached.job_id)).status_code == 200
    assert cached.sql.writes() == []
    assert cached.sql.commits == 0


def test_a_revoked_key_is_refused_once_its_cache_entry_expires(cached: CachedApi) -> None:
    key = cached.new_key()
    with cached.client(key) as c:
        assert c.get("/v1/jobs").status_code == 200
        with cached.maker.begin() as s:
            revoke_api_key(s, key[:10])
        # The bound: this process trusted the key for up to TTL seconds after checking it.
        assert c.get("/v1/jobs").status_code == 200
        cached.clock.advance(TTL)
        r = c.get("/v1/jobs")
    assert r.status_code == 401
    assert r.json()["error"]["message"] == "this API key was revoked"


def test_a_key_is_checked_again_when_its_entry_expires(cached: CachedApi) -> None:
    with cached.client(cached.key) as c:
        c.get("/v1/jobs")
        settle(cached)
        cached.sql.clear()
        c.get("/v1/jobs")
        assert cached.sql.touching("api_keys") == []
        cached.clock.advance(TTL)
        c.get("/v1/jobs")
    assert cached.sql.touching("api_keys") != []


def test_last_use_is_still_recorded(cached: CachedApi) -> None:
    long_ago = utcnow() - timedelta(hours=1)
    with cached.maker.begin() as s:
        s.execute(update(ApiKey).values(last_used_at=long_ago))
    cached.clock.advance(TTL)  # whatever this process remembers has expired
    with cached.client(cached.key) as c:
        assert c.get(f"/v1/jobs/{cached.job_id}").status_code == 200
    # Written beside the request, not in it: soon after the response.

    def recorded() -> bool:
        with cached.maker() as s:
            last_used = s.scalars(select(ApiKey.last_used_at)).all()
        return any(t is not None and t > long_ago + timedelta(minutes=59) for t in last_used)

    wait_until(recorded, 10, "the key's last use to be recorded", every=0.05)


def test_a_request_never_waits_for_the_last_use_write(cached: CachedApi) -> None:
    """On SQLite the write queues behind every other writer (a worker starting a job): a
    request that verifies its key is answered while another connection holds the write
    lock, and the last use is written once the lock is free."""
    key = cached.new_key()
    locker = cached.maker.kw["bind"].connect()
    locker.exec_driver_sql("BEGIN IMMEDIATE")  # the write lock, as a worker's transaction
    try:
        with cached.client(key) as c:
            t0 = time.monotonic()
            assert c.get(f"/v1/jobs/{cached.job_id}").status_code == 200
            waited = time.monotonic() - t0
        with cached.maker() as s:
            stamped = s.scalars(select(ApiKey.last_used_at).where(
                ApiKey.key_hash == hash_key(key))).one()
    finally:
        locker.exec_driver_sql("ROLLBACK")
        locker.close()
    assert stamped is None  # not written while the lock was held
    assert waited < 5  # answered without waiting out the lock (busy_timeout 30 s)

    def stamp() -> Any:
        with cached.maker() as s:
            return s.scalars(select(ApiKey.last_used_at).where(
                ApiKey.key_hash == hash_key(key))).one()

    wait_until(stamp, 10, "the last use to be written once the lock is gone", every=0.05)


def test_a_key_in_use_is_verified_again_before_its_entry_expires(cached: CachedApi) -> None:
    """Past half its ttl, a request is answered from the entry and starts a verification
    beside it; the entry then lasts a full ttl from that verification, so a polling client
    never meets an expired entry (whose verification all its requests would wait for)."""
    with cached.client(cached.key) as c:
        c.get("/v1/jobs")
        cached.clock.advance(TTL * 0.6)
        cached.sql.clear()
        assert c.get("/v1/jobs").status_code == 200
        # Verified again, in the background; its entry is written when the verification
        # returns, which then leaves the checks in flight.
        wait_until(lambda: cached.sql.touching("api_keys"), 10, "the key verified again",
                   every=0.02)
        wait_until(lambda: not cached.app.state.key_checks, 10, "the verification to return",
                   every=0.02)
        cached.clock.advance(TTL * 0.45)  # past the first entry's ttl, not yet half the new
        cached.sql.clear()
        assert c.get("/v1/jobs").status_code == 200
    assert [q for q in cached.sql.touching("api_keys") if "SELECT" in q.upper()] == []


def test_a_refresh_that_finds_the_key_revoked_ends_its_entry(cached: CachedApi) -> None:
    key = cached.new_key()
    with cached.client(key) as c:
        assert c.get("/v1/jobs").status_code == 200
        with cached.maker.begin() as s:
            revoke_api_key(s, s.scalars(select(ApiKey.id).where(
                ApiKey.key_hash == hash_key(key))).one())
        cached.clock.advance(TTL * 0.6)
        assert c.get("/v1/jobs").status_code == 200  # within the bound: still the entry's
        # Refused before the entry's ttl ran out (the clock is the test's: it stands still).
        status = wait_until(lambda: (code := c.get("/v1/jobs").status_code) != 200 and code,
                            10, "the revoked key to be refused", every=0.02)
    assert status == 401


def test_many_requests_checking_their_key_at_once_all_complete(cached: CachedApi) -> None:
    """Each checks its key in the database while it may already hold a database slot for
    its session: more of them than there are slots must not wait on each other."""
    remembering = cached.app.state.key_cache
    cached.app.state.key_cache = KeyCache(ttl=0)  # every request checks its key
    headers = {"Authorization": f"Bearer {cached.key}"}
    tls = ssl.create_default_context()  # one for all: building one per client is slow
    barrier = threading.Barrier(40)

    def get(_: int) -> tuple[int, float]:
        with httpx.Client(base_url=cached.url, headers=headers, timeout=25, verify=tls) as c:
            c.get("/healthz")
            barrier.wait()
            t0 = time.monotonic()
            statuses = [c.get(f"/v1/jobs/{cached.job_id}/checkpoints").status_code for _ in range(5)]
            return max(statuses), time.monotonic() - t0

    try:
        with ThreadPoolExecutor(40) as pool:
            results = list(pool.map(get, range(40)))
    finally:
        cached.app.state.key_cache = remembering
    assert [s for s, _ in results] == [200] * 40
    assert max(t for _, t in results) < 15  # the pool's 30 s timeout was never waited out


def test_requests_that_miss_the_cache_together_check_their_key_once(cached: CachedApi) -> None:
    """A dashboard's key expires in the middle of its load: the requests in flight wait for
    one check instead of each making its own (the check is slowed here, so that all of them
    arrive while it runs)."""
    engine = cached.maker.kw["bind"]
    checks: list[str] = []

    def slow_key_check(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "api_keys" in statement:
            checks.append(statement)
            time.sleep(0.5)

    event.listen(engine, "before_cursor_execute", slow_key_check)
    headers = {"Authorization": f"Bearer {cached.key}"}
    tls = ssl.create_default_context()
    barrier = threading.Barrier(30)

    def get(_: int) -> int:
        with httpx.Client(base_url=cached.url, headers=headers, timeout=25, verify=tls) as c:
            c.get("/healthz")
            barrier.wait()
            return c.get(f"/v1/jobs/{cached.job_id}").status_code

    cached.clock.advance(TTL)  # the key's entry has expired
    try:
        with ThreadPoolExecutor(30) as pool:
            statuses = list(pool.map(get, range(30)))
    finally:
        event.remove(engine, "before_cursor_execute", slow_key_check)
    assert statuses == [200] * 30
    assert len(checks) == 1


def test_an_unknown_key_is_never_remembered(cached: CachedApi) -> None:
    bogus = "ft_" + secrets.token_urlsafe(32)
    with cached.client(bogus) as c:
        assert c.get("/v1/jobs").status_code == 401
        cached.sql.clear()
        assert c.get("/v1/jobs").status_code == 401
    assert cached.sql.touching("api_keys") != []


def test_cache_entries_expire_and_stay_bounded() -> None:
    clock = FakeClock()
    cache = KeyCache(ttl=5, max_entries=2, clock=clock)
    tenant = Tenant(id="ten-1", name="t")
    cache.put("a", tenant)
    assert cache.get("a") is tenant
    clock.advance(4.9)
    assert cache.get("a") is tenant
    clock.advance(0.1)
    assert cache.get("a") is None
    for k in "abc":
        cache.put(k, tenant)
    assert len(cache._entries) <= 2
    off = KeyCache(ttl=0, clock=clock)
    off.put("a", tenant)
    assert off.get("a") is None
