"""The unit of work: commit, then the after-commit hooks; on error, roll back and drop them.
The event loop's read-only engine on a SQLite file, and telling a lock timeout apart. A
select on the driver's cursor reads what SQLAlchemy reads."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    Table,
    bindparam,
    create_engine,
    insert,
    select,
    text,
)
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Job, Tenant, new_id, utcnow
from core.db.session import (
    DriverSelect,
    LoopReads,
    after_commit,
    is_lock_timeout,
    make_engine,
    make_loop_read_engine,
    savepoint,
    unit_of_work,
)


@pytest.fixture
def maker(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(sqlite_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


def names(maker: sessionmaker[Session]) -> list[str]:
    with maker() as s:
        return list(s.scalars(select(Tenant.name)))


def test_hooks_run_after_the_commit_and_see_its_rows(maker: sessionmaker[Session]) -> None:
    seen: list[list[str]] = []
    with unit_of_work(maker) as s:
        s.add(Tenant(name="committed"))
        after_commit(s, lambda: seen.append(names(maker)))  # reads on its own connection
        assert seen == []
    assert seen == [["committed"]]


def test_an_error_rolls_back_and_drops_the_hooks(maker: sessionmaker[Session]) -> None:
    ran: list[str] = []
    with pytest.raises(RuntimeError), unit_of_work(maker) as s:
        s.add(Tenant(name="rolled-back"))
        s.flush()
        after_commit(s, lambda: ran.append("hook"))
        raise RuntimeError("the request failed")
    assert ran == [] and names(maker) == []


def test_a_savepoint_commits_nothing_before_the_unit_of_work(
    maker: sessionmaker[Session],
) -> None:
    # The Idempotency-Key insert (api/services/jobs/commands.py): on SQLite a bare
    # begin_nested() opened the outermost transaction and its release committed the job
    # while the request was still running, so a later failure could not take it back.
    with pytest.raises(RuntimeError), unit_of_work(maker) as s:
        names_before = list(s.scalars(select(Tenant.name)))  # a read first, as submit does
        with savepoint(s):
            s.add(Tenant(name="inside-the-savepoint"))
        assert names(maker) == names_before  # another connection does not see it yet
        raise RuntimeError("the request fails after the insert")
    assert "inside-the-savepoint" not in names(maker)


def test_an_error_in_a_savepoint_undoes_only_the_savepoint(
    maker: sessionmaker[Session],
) -> None:
    with unit_of_work(maker) as s:
        s.add(Tenant(name="outer"))
        s.flush()
        with pytest.raises(RuntimeError), savepoint(s):
            s.add(Tenant(name="inner"))
            s.flush()
            raise RuntimeError
    assert names(maker) == ["outer"]


def test_a_failing_hook_is_logged_not_raised(
    maker: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise ConnectionError("broker down")

    with caplog.at_level(logging.ERROR), unit_of_work(maker) as s:
        s.add(Tenant(name="kept"))
        after_commit(s, broken)
        after_commit(s, lambda: ran.append("next"))
    assert names(maker) == ["kept"] and ran == ["next"]
    assert "after-commit hook" in caplog.text


def test_the_loop_read_engine_reads_the_same_file_and_cannot_write(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    loop_engine = make_loop_read_engine(engine)
    assert loop_engine is not None
    try:
        with unit_of_work(sessionmaker(bind=engine)) as s:
            s.add(Tenant(name="seen-by-the-loop"))
        with sessionmaker(bind=loop_engine)() as s:
            assert "seen-by-the-loop" in s.scalars(select(Tenant.name)).all()
            with pytest.raises(OperationalError, match="readonly"):
                s.execute(insert(Tenant).values(id="ten-x", name="written-by-the-loop"))
    finally:
        loop_engine.dispose()
        engine.dispose()


@pytest.mark.parametrize(
    "url", ["sqlite://", "sqlite:///:memory:", "postgresql+psycopg://u@127.0.0.1:1/none"]
)
def test_no_loop_read_engine_where_reads_belong_in_threads(url: str) -> None:
    # In-memory: a second engine would open another, empty database. PostgreSQL: a read
    # waits on a socket. (Nothing connects: engines connect on first use.)
    assert make_loop_read_engine(create_engine(url)) is None


def test_a_read_that_waited_out_its_lock_is_told_apart(tmp_path: Path) -> None:
    # A rollback-journal database (not WAL), so that a writer's exclusive lock stops readers.
    path = tmp_path / "locked.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("CREATE TABLE t (x INTEGER)")
    reader = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.01})
    writer.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(OperationalError) as locked, reader.connect() as conn:
            conn.execute(text("SELECT x FROM t")).all()
        assert is_lock_timeout(locked.value)
        writer.execute("ROLLBACK")
        with pytest.raises(OperationalError) as other, reader.connect() as conn:
            conn.execute(text("SELECT nope FROM t")).all()
        assert not is_lock_timeout(other.value)
    finally:
        writer.close()
        reader.dispose()


def test_loop_reads_see_what_was_committed_since_the_last_read(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    loop_engine = make_loop_read_engine(engine)
    assert loop_engine is not None
    reads = LoopReads(loop_engine)

    def tenant_names(session: Session) -> list[str]:
        return list(session.scalars(select(Tenant.name)))

    try:
        assert "later" not in reads.run(tenant_names)
        with unit_of_work(sessionmaker(bind=engine)) as s:
            s.add(Tenant(name="later"))
        assert "later" in reads.run(tenant_names)  # the same connection, a new transaction
        with pytest.raises(ZeroDivisionError):
            reads.run(lambda session: 1 / 0)
        assert "later" in reads.run(tenant_names)  # a failed read leaves it usable
    finally:
        reads.close()
        engine.dispose()


@pytest.mark.parametrize("db", ["sqlite_url", "pg_url"])
def test_a_driver_select_reads_what_sqlalchemy_reads(db: str, request: pytest.FixtureRequest) -> None:
    engine = make_engine(request.getfixturevalue(db))
    job_id, now = new_id("job"), utcnow()
    query = DriverSelect(
        select(Job.id, Job.created_at, Job.finished_at, Job.spec, Job.train_loss, Job.step,
               Job.status, Tenant.name.label("tenant"))
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.id == bindparam("job_id"), Job.created_at <= bindparam("now"))
    )  # fmt: skip
    try:
        with unit_of_work(sessionmaker(bind=engine)) as s:
            tenant = Tenant(name=f"driver-{job_id}")
            s.add(tenant)
            s.flush()
            s.execute(insert(Job).values(id=job_id, tenant_id=tenant.id, status="running",
                                         spec={"a": [1, {"b": None}]}, created_at=now,
                                         train_loss=0.25, step=3))
        with Session(engine) as s:
            params = {"job_id": job_id, "now": now}
            expected = [tuple(r) for r in s.execute(query.statement, params)]
            rows = query.rows(s, params)
        assert [tuple(r) for r in rows] == expected
        assert (rows[0].created_at, rows[0].spec, rows[0].tenant) == (
            now, {"a": [1, {"b": None}]}, f"driver-{job_id}")
        assert rows[0].created_at.utcoffset() is not None and rows[0].finished_at is None
    finally:
        engine.dispose()


def test_a_lock_met_by_a_driver_select_is_told_apart(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("CREATE TABLE t (x INTEGER)")
    reader = create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.01})
    query = DriverSelect(select(Table("t", MetaData(), Column("x", Integer)).c.x))
    writer.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(OperationalError) as locked, Session(reader) as s:
            query.rows(s, {})
        assert is_lock_timeout(locked.value)
        writer.execute("INSERT INTO t VALUES (7)")
        writer.execute("COMMIT")
        with Session(reader) as s:
            assert [r.x for r in query.rows(s, {})] == [7]
    finally:
        writer.close()
        reader.dispose()
