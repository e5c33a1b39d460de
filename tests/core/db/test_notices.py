"""PostgreSQL's commit notices (migration 0014, core/db/notices.py), on a real database: a
commit by another connection moves the version once, a rollback not at all, this process's
own commits at once; every table notifies; a lost connection keeps nothing until a new one
listens, in a new generation."""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, insert, text, update

from core.db.models import Base, Tenant, new_id, utcnow
from core.db.notices import CommitNotices
from core.db.session import make_engine

WAIT = 10.0


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    e = make_engine(pg_url)
    yield e
    e.dispose()


@pytest.fixture
def notices(engine: Engine) -> Iterator[CommitNotices]:
    n = CommitNotices(engine, reconnect_seconds=0.1)
    yield n
    n.close()


def seen(version: Hashable) -> int:
    assert isinstance(version, tuple), "not listening"
    return int(version[1])


def add_tenant(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(Tenant).values(id=new_id("ten"), name=new_id("t"),
                                           created_at=utcnow()))


def wait_for_seen(notices: CommitNotices, at_least: int) -> Hashable:
    deadline = time.monotonic() + WAIT
    while True:
        v = notices.version()
        if isinstance(v, tuple) and v[1] >= at_least:
            return v
        assert time.monotonic() < deadline, f"no notice after {WAIT} s: {v}"
        time.sleep(0.01)


def test_every_table_notifies_its_commits(engine: Engine) -> None:
    with engine.connect() as conn:
        with_trigger = set(conn.scalars(text(
            "SELECT c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "WHERE t.tgname = 'ftune_notify_commit'")))
    assert set(Base.metadata.tables) <= with_trigger, set(Base.metadata.tables) - with_trigger


def test_a_commit_by_another_connection_moves_the_version_once(
    engine: Engine, notices: CommitNotices
) -> None:
    before = notices.version()
    assert notices.version() == before  # nothing committed: the same version
    add_tenant(engine)
    after = wait_for_seen(notices, seen(before) + 1)
    assert seen(after) == seen(before) + 1
    assert after != before


def test_a_transaction_of_many_writes_is_one_notice(
    engine: Engine, notices: CommitNotices
) -> None:
    before = seen(notices.version())
    with engine.begin() as conn:
        ten = new_id("ten")
        conn.execute(insert(Tenant).values(id=ten, name=new_id("t"), created_at=utcnow()))
        conn.execute(update(Tenant).where(Tenant.id == ten).values(name=new_id("t")))
    assert seen(wait_for_seen(notices, before + 1)) == before + 1


def test_a_rolled_back_write_sends_nothing(engine: Engine, notices: CommitNotices) -> None:
    before = seen(notices.version())
    with engine.connect() as conn:
        conn.execute(insert(Tenant).values(id=new_id("ten"), name=new_id("t"),
                                           created_at=utcnow()))
        conn.rollback()
    add_tenant(engine)  # the next notice: only this one arrives
    assert seen(wait_for_seen(notices, before + 1)) == before + 1


def test_this_processs_own_commit_is_seen_at_once(notices: CommitNotices) -> None:
    before = notices.version()
    notices.committed_here()
    assert notices.version() != before


def test_a_lost_connection_keeps_nothing_until_it_listens_again(
    engine: Engine, notices: CommitNotices
) -> None:
    before: Any = notices.version()
    with engine.begin() as conn:
        killed = conn.scalar(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE query = 'LISTEN ftune_commits' AND datname = current_database()"))
    assert killed == 1
    deadline = time.monotonic() + WAIT
    lost = notices.version()
    while isinstance(lost, tuple):  # until the broken socket is read
        assert time.monotonic() < deadline
        time.sleep(0.01)
        lost = notices.version()
    assert lost != before  # a new object, equal to nothing: no body is kept meanwhile
    while not isinstance(again := notices.version(), tuple):
        assert time.monotonic() < deadline, "not listening again"
        time.sleep(0.05)
    assert again[0] == before[0] + 1  # a new generation: nothing from before it matches
    add_tenant(engine)
    assert seen(wait_for_seen(notices, again[1] + 1)) == again[1] + 1
