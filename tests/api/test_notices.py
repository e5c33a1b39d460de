"""PostgreSQL's commit notices (migration 0014, api/commit_notices.py), on a real database: a job's
``own`` version moves with a commit to its own rows or to a table that is no job's, and not
with another job's; ``any`` moves with every commit, once a transaction; a rollback moves
nothing; this process's own commits move everything at once; every table notifies; a job
forgotten past the tracked number reads as changed, never as unchanged; a lost connection
keeps nothing until a new one listens, in a new generation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, insert, select, text, update

from api import commit_notices as notices_module
from api.commit_notices import CommitNotices
from api.readcache import Version
from core.db.models import Base, Job, Tenant, new_id, utcnow
from core.db.session import make_engine
from testkit.wait import wait_until
from tests.utils.api import set_step

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


def new_job(engine: Engine, job_id: str | None = None) -> str:
    job_id, now = job_id or new_id("job"), utcnow()
    with engine.begin() as conn:
        tenant = conn.scalar(select(Tenant.id).limit(1))
        if tenant is None:
            tenant = new_id("ten")
            conn.execute(insert(Tenant).values(id=tenant, name=new_id("t"), created_at=now))
        conn.execute(insert(Job).values(id=job_id, tenant_id=tenant, status="running", spec={},
                                        created_at=now, queued_at=now, attempt=1))
    return job_id


def add_tenant(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(insert(Tenant).values(id=new_id("ten"), name=new_id("t"),
                                           created_at=utcnow()))


def caught_up(notices: CommitNotices, engine: Engine, job_id: str) -> Version:
    """``job_id``'s version once every commit made so far has been noticed: a marker commit
    after them, whose notice arrives last (PostgreSQL delivers them in commit order)."""
    marker = new_id("job")
    before = notices.version(marker)  # before its commit: its notice moves it
    new_job(engine, marker)
    wait_until(lambda: notices.version(marker).own != before.own, WAIT, "the marker's notice",
               every=0.01)
    return notices.version(job_id)


def settled(notices: CommitNotices, job_id: str, before: Version) -> Version:
    """The version once the notice of a commit just made has arrived (``any`` moved)."""
    return wait_until(lambda: (v := notices.version(job_id)).any != before.any and v, WAIT,
                      "the commit's notice", every=0.01)


def test_every_table_notifies_its_commits(engine: Engine) -> None:
    with engine.connect() as conn:
        triggers = set(conn.execute(text(
            "SELECT c.relname, t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
            "WHERE t.tgname LIKE 'ftune_notify_%'")).tuples())
    # rate_windows is written at every inference request, and no API process caches what it
    # holds: its notices would only wake every process's read cache (migration 0020).
    tables = set(Base.metadata.tables) - {"rate_windows"}
    assert tables <= {table for table, _ in triggers}, tables - {t for t, _ in triggers}
    per_job = {table for table, name in triggers if name == "ftune_notify_job"}
    assert per_job == {"jobs", "job_attempts", "checkpoints", "job_events"}


def test_a_commit_to_a_jobs_row_moves_its_own_version(
    engine: Engine, notices: CommitNotices
) -> None:
    job = new_job(engine)
    before = caught_up(notices, engine, job)
    assert notices.version(job) == before  # nothing committed since: the same
    set_step(engine, job, 1)
    after = settled(notices, job, before)
    assert after.own != before.own


def test_another_jobs_commit_leaves_a_jobs_own_version(
    engine: Engine, notices: CommitNotices
) -> None:
    job, other = new_job(engine), new_job(engine)
    before = caught_up(notices, engine, job)
    set_step(engine, other, 7)
    after = settled(notices, job, before)
    assert after.own == before.own and after.any != before.any


def test_a_commit_to_a_table_of_no_job_moves_every_own_version(
    engine: Engine, notices: CommitNotices
) -> None:
    job = new_job(engine)
    before = caught_up(notices, engine, job)
    add_tenant(engine)  # tenants, workers...: what a queued job's place may depend on
    assert settled(notices, job, before).own != before.own


def test_a_transaction_of_many_writes_to_a_job_is_one_notice(
    engine: Engine, notices: CommitNotices
) -> None:
    job = new_job(engine)
    before = caught_up(notices, engine, job)
    with engine.begin() as conn:
        for step in range(3):
            conn.execute(update(Job).where(Job.id == job).values(step=step))
    after = settled(notices, job, before)
    assert after.any[1] == before.any[1] + 1  # type: ignore[index]


def test_a_rolled_back_write_sends_nothing(engine: Engine, notices: CommitNotices) -> None:
    job, other = new_job(engine), new_job(engine)
    before = caught_up(notices, engine, job)
    with engine.connect() as conn:
        conn.execute(update(Job).where(Job.id == job).values(step=99))
        conn.rollback()
    set_step(engine, other, 3)  # the next notice: only this one arrives
    after = settled(notices, job, before)
    assert after.own == before.own
    assert after.any[1] == before.any[1] + 1  # type: ignore[index]


def test_this_processs_own_commit_moves_everything_at_once(
    engine: Engine, notices: CommitNotices
) -> None:
    job = new_job(engine)
    before = caught_up(notices, engine, job)
    notices.committed_here()
    after = notices.version(job)
    assert after.own != before.own and after.any != before.any


def test_a_job_forgotten_past_the_tracked_number_reads_as_changed(
    engine: Engine, notices: CommitNotices, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notices_module, "TRACKED_JOBS", 2)
    first, second, third = new_job(engine), new_job(engine), new_job(engine)
    kept = caught_up(notices, engine, first)
    set_step(engine, second, 1)
    set_step(engine, third, 1)  # the third tracked: the oldest (first) is forgotten
    wait_until(lambda: notices.version(first).own != kept.own, WAIT,
               "the forgotten job to read as changed", every=0.01)


def test_a_lost_connection_keeps_nothing_until_it_listens_again(
    engine: Engine, notices: CommitNotices
) -> None:
    job = new_job(engine)
    before = caught_up(notices, engine, job)
    with engine.begin() as conn:
        killed = conn.scalar(text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE query = 'LISTEN ftune_commits' AND datname = current_database()"))
    assert killed == 1
    lost = wait_until(lambda: not isinstance((v := notices.version(job)).own, tuple) and v,
                      WAIT, "the lost connection to be read", every=0.01)
    assert lost.own != before.own and lost.any != before.any  # equal to nothing: none kept
    again = wait_until(lambda: isinstance((v := notices.version(job)).own, tuple) and v,
                       WAIT, "listening again", every=0.05)
    assert again.own[0] == before.own[0] + 1  # type: ignore[index]  # a new generation
    set_step(engine, job, 8)
    assert settled(notices, job, again).own != again.own
