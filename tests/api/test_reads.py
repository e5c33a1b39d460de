"""The hot reads (job, list, events) on a SQLite file run on the event loop, on its own
read-only connection: no thread. A read there that meets a lock is read again in a thread,
and answers. On PostgreSQL they run in the read threads, and a polled job is answered again
from the body kept while no commit was notified (api/commit_notices.py; the SQLite side of
kept bodies is tests/api/test_readcache.py)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, event, insert, select
from sqlalchemy.orm import Session, sessionmaker

from api.main import create_app
from api.services.keys import create_api_key, hash_key
from core.db.models import ApiKey, Job, JobEvent, Tenant, new_id, utcnow
from core.db.session import make_engine
from core.infra.settings import Settings
from testkit.wait import wait_until
from tests.utils.api import ServerThread, migrated_sqlite_url, set_step

HOT_READS = ["/v1/jobs/{job}", "/v1/jobs", "/v1/jobs/{job}/events"]


@dataclass
class Served:
    app: FastAPI
    client: httpx.Client
    job_id: str
    maker: sessionmaker[Session]  # the API's own sessions
    key: str

    def get_all(self) -> list[int]:
        return [self.client.get(p.format(job=self.job_id)).status_code for p in HOT_READS]


def serve(database_url: str, tmp: pytest.TempPathFactory,
          read_cache_seconds: float = 0) -> Iterator[Served]:
    engine = make_engine(database_url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    # By default every GET reads: kept job bodies (api/readcache.py) would answer a
    # repeated GET without one.
    settings = Settings(data_dir=tmp.mktemp("ftune") / "data", DATABASE_URL=database_url,
                        BROKER_URL="filesystem://", job_read_cache_seconds=read_cache_seconds)
    app = create_app(settings, enqueue=lambda job_id: None, session_factory=maker)
    with maker.begin() as s:
        key = create_api_key(s, "reader", "tests")
    with maker.begin() as s:
        tenant_id = s.scalars(select(Tenant.id).where(Tenant.name == "reader")).one()
        job_id, now = new_id("job"), utcnow()
        s.execute(insert(Job).values(id=job_id, tenant_id=tenant_id, status="running", spec={},
                                     created_at=now, queued_at=now, step=3, total_steps=10,
                                     attempt=1))
        s.execute(insert(JobEvent).values(job_id=job_id, type="progress", created_at=now))
    try:
        with ServerThread(app) as url, httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=20
        ) as client:
            yield Served(app, client, job_id, maker, key)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def on_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(migrated_sqlite_url(tmp_path_factory), tmp_path_factory)


def read_threads_started(app: FastAPI) -> bool:
    return getattr(app.state, "read_executor", None) is not None  # api/deps.py read_executor


def test_reads_on_a_sqlite_file_take_no_thread(on_sqlite: Served) -> None:
    assert on_sqlite.get_all() == [200, 200, 200]
    assert not read_threads_started(on_sqlite.app)


def test_a_read_that_meets_a_lock_on_the_loop_is_read_again_in_a_thread(
    on_sqlite: Served,
) -> None:
    loop_engine: Engine = on_sqlite.app.state.loop_reads.engine
    locked: list[str] = []

    def busy_once(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not locked:  # what SQLite raises when its busy timeout runs out
            locked.append(statement)
            error = sqlite3.OperationalError("database is locked")
            error.sqlite_errorcode = 5  # SQLITE_BUSY
            raise error

    event.listen(loop_engine, "before_cursor_execute", busy_once)
    try:
        r = on_sqlite.client.get(f"/v1/jobs/{on_sqlite.job_id}")
    finally:
        event.remove(loop_engine, "before_cursor_execute", busy_once)
    assert len(locked) == 1
    assert r.status_code == 200
    assert (r.json()["id"], r.json()["status"]) == (on_sqlite.job_id, "running")
    assert read_threads_started(on_sqlite.app)


def test_other_errors_on_the_loop_are_not_retried(on_sqlite: Served) -> None:
    loop_engine: Engine = on_sqlite.app.state.loop_reads.engine

    def broken(*args: Any) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    event.listen(loop_engine, "before_cursor_execute", broken)
    try:
        r = on_sqlite.client.get(f"/v1/jobs/{on_sqlite.job_id}")
    finally:
        event.remove(loop_engine, "before_cursor_execute", broken)
    assert r.status_code == 500


def test_reads_on_postgresql_run_in_the_read_threads(
    fresh_pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    served = serve(fresh_pg_url, tmp_path_factory)
    on_pg = next(served)
    try:
        assert on_pg.app.state.loop_reads is None
        assert on_pg.get_all() == [200, 200, 200]
        assert read_threads_started(on_pg.app)
    finally:
        served.close()




@pytest.fixture(scope="module")
def on_pg(fresh_pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(fresh_pg_url, tmp_path_factory)


def test_a_job_read_on_postgresql_is_one_statement_in_autocommit(on_pg: Served) -> None:
    """No BEGIN, no ROLLBACK, no ping, no second statement for the attempts: each was a
    round trip (core/db/session.py make_read_engine)."""
    read_engine: Engine = on_pg.app.state.read_sessionmaker.kw["bind"]
    with read_engine.connect() as c:
        assert c.connection.dbapi_connection.autocommit  # type: ignore[union-attr]
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(read_engine, "before_cursor_execute", record)
    try:
        assert on_pg.client.get(f"/v1/jobs/{on_pg.job_id}").status_code == 200
    finally:
        event.remove(read_engine, "before_cursor_execute", record)
    assert len(statements) == 1, statements


def test_a_read_on_postgresql_waits_for_no_slot_of_the_main_pool(on_pg: Served) -> None:
    """The read engine's pool has a connection for each read thread: with every slot of
    the main pool taken (api/deps.py db_slots), the hot reads still answer."""
    on_pg.app.state.db_slots = asyncio.Semaphore(0)
    try:
        assert on_pg.get_all() == [200, 200, 200]
    finally:
        on_pg.app.state.db_slots = None  # made again at the next request that needs one


def test_a_read_on_a_connection_the_server_closed_is_read_again(on_pg: Served) -> None:
    """The read engine pings no connection before use: a read that finds its connection
    closed by the server (a restart, an idle timeout) runs again on a fresh one."""
    read_engine: Engine = on_pg.app.state.read_sessionmaker.kw["bind"]
    assert on_pg.get_all() == [200, 200, 200]  # the pool holds connections now
    with read_engine.connect() as probe:
        database = probe.exec_driver_sql("SELECT current_database()").scalar()
    admin = make_engine(str(read_engine.url.set(database="postgres").render_as_string(
        hide_password=False)))
    try:
        with admin.connect() as c:
            killed = c.exec_driver_sql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = %(db)s AND pid <> pg_backend_pid()", {"db": database}
            ).scalar()
            c.commit()
    finally:
        admin.dispose()
    assert killed
    assert on_pg.get_all() == [200, 200, 200]


@pytest.mark.parametrize("served", ["on_sqlite", "on_pg"])
def test_a_poll_sees_what_was_committed_just_before_it(
    served: str, request: pytest.FixtureRequest
) -> None:
    """Each poll reads what is committed (a cancel, the worker's progress): nothing cached,
    on the loop's connection (SQLite) or a read thread's (PostgreSQL)."""
    on: Served = request.getfixturevalue(served)
    engine = make_engine(on.app.state.settings.database_url)
    try:
        for step in (5, 6):
            assert on.client.get(f"/v1/jobs/{on.job_id}").json()["progress"]["step"] != step
            set_step(engine, on.job_id, step)
            assert on.client.get(f"/v1/jobs/{on.job_id}").json()["progress"]["step"] == step
    finally:
        engine.dispose()


# ------------------------------------------------ kept job bodies on PostgreSQL (notices)

KEPT_SECONDS = 10.0  # the most allowed: only a notice ends a body within the 5 s waited


@pytest.fixture(scope="module")
def on_pg_kept(fresh_pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve(fresh_pg_url, tmp_path_factory, read_cache_seconds=KEPT_SECONDS)


def test_a_polled_job_on_postgresql_is_answered_again_without_a_read(
    on_pg_kept: Served,
) -> None:
    read_engine: Engine = on_pg_kept.app.state.read_sessionmaker.kw["bind"]
    url = f"/v1/jobs/{on_pg_kept.job_id}"
    on_pg_kept.client.get(url)  # the key's first use: it records the use (a commit)

    def used() -> Any:
        with on_pg_kept.maker() as s:
            return s.scalar(select(ApiKey.last_used_at)
                            .where(ApiKey.key_hash == hash_key(on_pg_kept.key)))

    wait_until(used, 5, "the key's use to be recorded", every=0.01)
    first = on_pg_kept.client.get(url)
    statements: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(read_engine, "before_cursor_execute", record)
    try:
        again = on_pg_kept.client.get(url)
    finally:
        event.remove(read_engine, "before_cursor_execute", record)
    assert first.status_code == again.status_code == 200
    assert statements == [] and again.content == first.content


def test_a_commit_by_another_process_reaches_a_polled_job_on_postgresql(
    on_pg_kept: Served,
) -> None:
    url = f"/v1/jobs/{on_pg_kept.job_id}"
    on_pg_kept.client.get(url)  # kept
    engine = make_engine(on_pg_kept.app.state.settings.database_url)  # as a worker writes
    try:
        set_step(engine, on_pg_kept.job_id, 41)
    finally:
        engine.dispose()
    # Its notice arrives as it commits; the kept body (10 s) would hide it otherwise.
    wait_until(lambda: on_pg_kept.client.get(url).json()["progress"]["step"] == 41, 5,
               "the poll to read step 41", every=0.01)


def test_the_apis_own_commit_is_read_by_the_next_poll_on_postgresql(
    on_pg_kept: Served,
) -> None:
    url = f"/v1/jobs/{on_pg_kept.job_id}"
    for step in (51, 52):
        on_pg_kept.client.get(url)  # kept
        set_step(on_pg_kept.maker, on_pg_kept.job_id, step)  # a session of the API's own
        assert on_pg_kept.client.get(url).json()["progress"]["step"] == step
