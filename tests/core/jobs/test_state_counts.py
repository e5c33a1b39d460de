"""core/jobs/state.py keeps jobs per status in job_status_counts as they move: the kept
counts equal a recount of the jobs, per status and per shard, on SQLite and PostgreSQL."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from core.db.migrate import upgrade_head
from core.db.models import Job, JobStatus, JobStatusCount, Tenant, utcnow
from core.db.session import make_engine
from core.jobs import state as jobstate
from core.jobs.state import Holder

MAX_ATTEMPTS = 3


@pytest.fixture(params=["sqlite", "postgres"])
def maker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    """A database of this test's own: the counts are server-wide."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ftune.db'}"
        upgrade_head(url)
        yield from _maker(url)
        return
    from testkit.pg import migrated_database

    with migrated_database("ftune_counts") as url:
        yield from _maker(url)


def _maker(url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(url)
    try:
        yield sessionmaker(bind=engine, expire_on_commit=False)
    finally:
        engine.dispose()


def _tenant(maker: sessionmaker[Session]) -> str:
    with maker.begin() as s:
        t = Tenant(name=f"counts-{secrets.token_hex(4)}")
        s.add(t)
        s.flush()
        return t.id


def _queue(maker: sessionmaker[Session], tenant: str) -> str:
    with maker.begin() as s:
        job = Job(tenant_id=tenant, spec={})
        jobstate.queue(s, job, now=utcnow(), event_data={})
        return job.id


def _claim(s: Session, job_id: str, worker: str = "w") -> Holder:
    assert jobstate.claim(s, job_id, worker_id=worker, max_attempts=MAX_ATTEMPTS, now=utcnow())
    attempt = s.scalar(select(Job.attempt).where(Job.id == job_id))
    assert attempt is not None
    return Holder(worker, attempt)


def _per_shard(s: Session) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], int]]:
    kept = {(r.status, r.shard): r.jobs for r in s.scalars(select(JobStatusCount)) if r.jobs}
    shard = func.substr(Job.id, func.length(Job.id), 1)
    recount = {(st, sh): n for st, sh, n in s.execute(
        select(Job.status, shard, func.count()).group_by(Job.status, shard)).all()}
    return kept, recount


def test_kept_counts_equal_a_recount_after_a_mix_of_moves(
        maker: sessionmaker[Session]) -> None:
    tenant = _tenant(maker)
    jobs = [_queue(maker, tenant) for _ in range(40)]
    now = utcnow()
    moves = iter(jobs)
    with maker.begin() as s:
        for j in [next(moves) for _ in range(3)]:  # run and succeeded
            h = _claim(s, j)
            assert jobstate.finish(s, j, h, previous=JobStatus.running, to=JobStatus.succeeded,
                                   now=now)
        j = next(moves)
        h = _claim(s, j)
        assert jobstate.finish(s, j, h, previous=JobStatus.running, to=JobStatus.failed, now=now,
                               error_code="trainer_crashed")
        j = next(moves)  # queued -> cancelled at once
        assert jobstate.request_cancel(s, j, previous=JobStatus.queued, now=now)
        j = next(moves)  # running -> cancelling -> cancelled
        h = _claim(s, j)
        assert jobstate.request_cancel(s, j, previous=JobStatus.running, now=now)
        assert jobstate.finish(s, j, h, previous=JobStatus.cancelling, to=JobStatus.cancelled,
                               now=now)
        j = next(moves)  # a cancel lands while the worker believes it still running
        h = _claim(s, j)
        assert jobstate.request_cancel(s, j, previous=JobStatus.running, now=now)
        assert jobstate.finish(s, j, h, previous=JobStatus.running, to=JobStatus.succeeded,
                               now=now)
        j = next(moves)  # requeued by a worker that shuts down, then claimed again
        h = _claim(s, j)
        assert jobstate.requeue(s, j, h, previous=JobStatus.running, why="shutdown", now=now)
        _claim(s, j, "w2")
        j = next(moves)  # lost by its worker: queued again
        h = _claim(s, j)
        assert jobstate.lose(s, j, previous=JobStatus.running, attempt=h.attempt,
                             to=JobStatus.queued, stale_before=now + timedelta(hours=1), now=now,
                             message="lost")
        j = next(moves)  # paused while running, resumed, claimed
        h = _claim(s, j)
        assert jobstate.request_pause(s, j, previous=JobStatus.running, now=now)
        assert jobstate.pause(s, j, h, now=now, checkpoint_step=None)
        assert jobstate.resume(s, j, now=now)
        _claim(s, j)
        j = next(moves)  # paused while queued, stays paused
        assert jobstate.request_pause(s, j, previous=JobStatus.queued, now=now)
        j = next(moves)  # a move that does not happen counts nothing
        assert not jobstate.finish(s, j, Holder("nobody", 9), previous=JobStatus.running,
                                   to=JobStatus.succeeded, now=now)
        j = next(moves)  # pausing, then cancelled
        _claim(s, j)
        assert jobstate.request_pause(s, j, previous=JobStatus.running, now=now)
        assert jobstate.request_cancel(s, j, previous=JobStatus.pausing, now=now)
    with maker() as s:
        kept = jobstate.counts_by_status(s)
        assert kept == jobstate.recount_by_status(s)
        assert sum(kept.values()) == 40
        assert {k: kept.get(k, 0) for k in ("queued", "running", "succeeded", "cancelling",
                                            "paused", "cancelled", "failed")} == {
            "queued": 29, "running": 2, "succeeded": 4, "cancelling": 1, "paused": 1,
            "cancelled": 2, "failed": 1}  # fmt: skip
        per_shard, recount = _per_shard(s)
        assert per_shard == recount


def test_a_move_rolled_back_counts_nothing(maker: sessionmaker[Session]) -> None:
    tenant = _tenant(maker)
    job = _queue(maker, tenant)
    with maker() as s:
        _claim(s, job)
        s.rollback()
    with maker() as s:
        assert jobstate.counts_by_status(s) == jobstate.recount_by_status(s) == {"queued": 1}


def test_concurrent_moves_of_many_jobs_lose_no_count(maker: sessionmaker[Session]) -> None:
    """Threads queueing, claiming and finishing jobs at once (on PostgreSQL they wait on
    each other's rows when their jobs share a shard): no update lost, none deadlocked."""
    tenant = _tenant(maker)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(8):
                j = _queue(maker, tenant)
                with maker.begin() as s:
                    h = _claim(s, j, f"w{n}")
                with maker.begin() as s:
                    assert jobstate.finish(s, j, h, previous=JobStatus.running,
                                           to=JobStatus.succeeded, now=utcnow())
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with maker() as s:
        assert jobstate.counts_by_status(s) == jobstate.recount_by_status(s) == {"succeeded": 48}
        per_shard, recount = _per_shard(s)
        assert per_shard == recount
