"""The job state machine: every move in MOVES works, every other one is refused, and a job
that moved meanwhile (or whose guard no longer holds) is left alone."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.db.migrate import upgrade_head
from core.db.models import Job, JobEvent, JobStatus, Tenant, utcnow
from core.db.session import make_engine
from core.jobs import state as jobstate
from core.jobs.state import MOVES, Holder, IllegalMove, Move

HOLDER = Holder("worker-a", 1)
MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def maker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sessionmaker[Session]]:
    """One migrated SQLite database for the module: each test makes its own jobs."""
    url = f"sqlite:///{tmp_path_factory.mktemp('jobstate') / 'ftune.db'}"
    upgrade_head(url)
    engine = make_engine(url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


def add_job(maker: sessionmaker[Session], status: str, **fields: Any) -> str:
    with maker.begin() as s:
        tenant = Tenant(name=f"tenant-{secrets.token_hex(6)}")
        s.add(tenant)
        s.flush()
        job = Job(tenant_id=tenant.id, status=status, spec={}, **fields)
        s.add(job)
        s.flush()
        return job.id


def state(maker: sessionmaker[Session], job_id: str) -> tuple[str, list[JobEvent]]:
    with maker() as s:
        job = s.get_one(Job, job_id)
        events = list(s.scalars(select(JobEvent).where(JobEvent.job_id == job_id,
                                                       JobEvent.type == "status")))
        return job.status, events


# What each move needs of the job for its guard to hold, and the call that makes it.
Setup = dict[str, Any]
Call = Callable[[Session, str, str, JobStatus], bool]


def _stale() -> Setup:
    return {"worker_id": HOLDER.worker_id, "attempt": HOLDER.attempt,
            "heartbeat_at": utcnow() - timedelta(hours=1)}


CASES: dict[Move, tuple[Callable[[str], Setup], Call]] = {
    Move.claim: (lambda f: {"attempt": 0},
                 lambda s, j, f, t: jobstate.claim(s, j, worker_id="w", max_attempts=MAX_ATTEMPTS,
                                                   now=utcnow())),
    Move.give_up: (lambda f: {"attempt": MAX_ATTEMPTS},
                   lambda s, j, f, t: jobstate.give_up(s, j, max_attempts=MAX_ATTEMPTS,
                                                       now=utcnow(), message="gave up")),
    Move.request_cancel: (lambda f: {},
                          lambda s, j, f, t: jobstate.request_cancel(s, j, previous=f,
                                                                     now=utcnow())),
    Move.honour_cancel: (
        lambda f: ({"cancel_requested_at": utcnow()} if f == JobStatus.queued
                   else {"worker_id": HOLDER.worker_id, "attempt": HOLDER.attempt}),
        lambda s, j, f, t: (jobstate.honour_cancel_queued(s, j, now=utcnow())
                            if f == JobStatus.queued
                            else jobstate.honour_cancel_running(s, j, HOLDER))),
    Move.finish: (lambda f: {"worker_id": HOLDER.worker_id, "attempt": HOLDER.attempt},
                  lambda s, j, f, t: jobstate.finish(s, j, HOLDER, previous=f, to=t,
                                                     now=utcnow())),
    Move.requeue: (lambda f: {"worker_id": HOLDER.worker_id, "attempt": HOLDER.attempt},
                   lambda s, j, f, t: jobstate.requeue(s, j, HOLDER, previous=f, why="shutdown",
                                                       now=utcnow())),
    Move.lose: (lambda f: _stale(),
                lambda s, j, f, t: jobstate.lose(s, j, previous=f, attempt=HOLDER.attempt, to=t,
                                                 stale_before=utcnow() - timedelta(minutes=1),
                                                 now=utcnow(), message="lost")),
    Move.request_pause: (lambda f: {},
                         lambda s, j, f, t: jobstate.request_pause(s, j, previous=f,
                                                                   now=utcnow())),
    Move.pause: (lambda f: {"worker_id": HOLDER.worker_id, "attempt": HOLDER.attempt},
                 lambda s, j, f, t: jobstate.pause(s, j, HOLDER, now=utcnow(),
                                                   checkpoint_step=3)),
    Move.resume: (lambda f: {}, lambda s, j, f, t: jobstate.resume(s, j, now=utcnow())),
}

UPDATES = sorted((m for m in MOVES if m[0] is not None), key=str)


def test_every_move_but_queue_has_a_case() -> None:
    assert {m for _, m, _ in UPDATES} == set(CASES)


@pytest.mark.parametrize("move", UPDATES, ids=str)
def test_allowed_move(maker: sessionmaker[Session],
                      move: tuple[JobStatus, Move, JobStatus]) -> None:
    frm, name, to = move
    setup, call = CASES[name]
    job_id = add_job(maker, frm, **setup(frm))
    with maker.begin() as s:
        assert call(s, job_id, frm, to) is True
    status, events = state(maker, job_id)
    assert status == to
    assert [(e.data["previous"], e.data["status"]) for e in events] == [(frm, to)]


@pytest.mark.parametrize("move", UPDATES, ids=str)
def test_move_of_a_job_that_moved_meanwhile_does_nothing(
    maker: sessionmaker[Session], move: tuple[JobStatus, Move, JobStatus]
) -> None:
    frm, name, to = move
    setup, call = CASES[name]
    for actual in set(JobStatus) - jobstate.sources(name, to):
        job_id = add_job(maker, actual, **setup(frm))
        with maker.begin() as s:
            assert call(s, job_id, frm, to) is False
        assert state(maker, job_id) == (actual, [])


DISALLOWED = [
    (frm, name, to)
    for frm, name, to in itertools.product([None, *JobStatus], Move, JobStatus)
    if (frm, name, to) not in MOVES
]


@pytest.mark.parametrize("move", DISALLOWED, ids=str)
def test_disallowed_move_raises(maker: sessionmaker[Session],
                                move: tuple[JobStatus | None, Move, JobStatus]) -> None:
    frm, name, to = move
    job_id = add_job(maker, frm or JobStatus.queued)
    with maker.begin() as s, pytest.raises(IllegalMove):
        jobstate._move(s, job_id, name, previous=str(frm), to=to, guard=[])
    assert state(maker, job_id)[1] == []


CANCELLABLE = {JobStatus.queued, JobStatus.running, JobStatus.pausing, JobStatus.paused}


@pytest.mark.parametrize("status", sorted(set(JobStatus) - CANCELLABLE))
def test_request_cancel_of_a_cancelling_or_finished_job_raises(
    maker: sessionmaker[Session], status: JobStatus
) -> None:
    job_id = add_job(maker, status)
    with maker.begin() as s, pytest.raises(IllegalMove):
        jobstate.request_cancel(s, job_id, previous=status, now=utcnow())


def test_queue_inserts_a_queued_job_with_its_event(maker: sessionmaker[Session]) -> None:
    now = utcnow()
    with maker.begin() as s:
        tenant = Tenant(name="queue-test")
        s.add(tenant)
        s.flush()
        job = Job(tenant_id=tenant.id, spec={}, created_at=now)
        jobstate.queue(s, job, now=now, event_data={"train_rows": 3, "eval_rows": None})
        job_id = job.id
    status, events = state(maker, job_id)
    assert status == JobStatus.queued
    assert [e.data for e in events] == [
        {"status": "queued", "previous": None, "train_rows": 3, "eval_rows": None}
    ]


def test_claim_refuses_a_job_whose_cancel_was_requested(maker: sessionmaker[Session]) -> None:
    job_id = add_job(maker, JobStatus.queued, cancel_requested_at=utcnow())
    with maker.begin() as s:
        assert not jobstate.claim(s, job_id, worker_id="w", max_attempts=3, now=utcnow())
    assert state(maker, job_id) == (JobStatus.queued, [])


def test_claim_refuses_a_job_out_of_attempts(maker: sessionmaker[Session]) -> None:
    job_id = add_job(maker, JobStatus.queued, attempt=3)
    with maker.begin() as s:
        assert not jobstate.claim(s, job_id, worker_id="w", max_attempts=3, now=utcnow())
        assert not jobstate.give_up(s, job_id, max_attempts=4, now=utcnow(), message="x")
    assert state(maker, job_id) == (JobStatus.queued, [])


def test_worker_moves_need_the_holding_attempt(maker: sessionmaker[Session]) -> None:
    job_id = add_job(maker, JobStatus.running, worker_id="worker-a", attempt=2)
    with maker.begin() as s:
        for other in (Holder("worker-a", 1), Holder("worker-b", 2)):
            assert not jobstate.finish(s, job_id, other, previous=JobStatus.running,
                                       to=JobStatus.succeeded, now=utcnow())
            assert not jobstate.requeue(s, job_id, other, previous=JobStatus.running,
                                        why="x", now=utcnow())
            assert not jobstate.honour_cancel_running(s, job_id, other)
    assert state(maker, job_id) == (JobStatus.running, [])


def test_lose_needs_a_stale_heartbeat_and_the_same_attempt(maker: sessionmaker[Session]) -> None:
    job_id = add_job(maker, JobStatus.running, worker_id="w", attempt=1, heartbeat_at=utcnow())
    cutoff = utcnow() - timedelta(minutes=1)
    with maker.begin() as s:
        assert not jobstate.lose(s, job_id, previous=JobStatus.running, attempt=1,
                                 to=JobStatus.queued, stale_before=cutoff, now=utcnow(),
                                 message="x")
        assert not jobstate.lose(s, job_id, previous=JobStatus.running, attempt=2,
                                 to=JobStatus.queued, stale_before=utcnow(), now=utcnow(),
                                 message="x")
    assert state(maker, job_id) == (JobStatus.running, [])


def test_lose_takes_a_job_no_worker_holds(maker: sessionmaker[Session]) -> None:
    job_id = add_job(maker, JobStatus.cancelling, attempt=1, heartbeat_at=utcnow())
    with maker.begin() as s:
        assert jobstate.lose(s, job_id, previous=JobStatus.cancelling, attempt=1,
                             to=JobStatus.cancelled, stale_before=utcnow() - timedelta(hours=1),
                             now=utcnow(), message="no worker")
    assert state(maker, job_id)[0] == JobStatus.cancelled


# --------------------------------------------------------------------------- pause, resume


@pytest.mark.parametrize("status", sorted(set(JobStatus) - {JobStatus.queued, JobStatus.running}))
def test_request_pause_of_a_job_neither_queued_nor_running_raises(
    maker: sessionmaker[Session], status: JobStatus
) -> None:
    job_id = add_job(maker, status)
    with maker.begin() as s, pytest.raises(IllegalMove):
        jobstate.request_pause(s, job_id, previous=status, now=utcnow())
    assert state(maker, job_id) == (status, [])


def test_pause_frees_the_worker_and_is_not_a_failed_attempt(
    maker: sessionmaker[Session]
) -> None:
    job_id = add_job(maker, JobStatus.pausing, worker_id=HOLDER.worker_id,
                     attempt=HOLDER.attempt, heartbeat_at=utcnow())
    with maker.begin() as s:
        assert jobstate.pause(s, job_id, HOLDER, now=utcnow(), checkpoint_step=7)
    with maker() as s:
        job = s.get_one(Job, job_id)
        assert (job.status, job.worker_id, job.heartbeat_at, job.pauses) == (
            JobStatus.paused, None, None, 1)
        assert job.paused_at is not None
    (event,) = state(maker, job_id)[1]
    assert event.data["checkpoint_step"] == 7 and event.data["attempt"] == HOLDER.attempt


def test_paused_attempts_do_not_use_up_the_attempt_budget(maker: sessionmaker[Session]) -> None:
    # Three attempts ran; two ended in a pause: one failure so far, so a fourth may start.
    job_id = add_job(maker, JobStatus.queued, attempt=MAX_ATTEMPTS, pauses=2)
    with maker.begin() as s:
        assert not jobstate.give_up(s, job_id, max_attempts=MAX_ATTEMPTS, now=utcnow(),
                                    message="x")
        assert jobstate.claim(s, job_id, worker_id="w", max_attempts=MAX_ATTEMPTS,
                              now=utcnow())
    with maker() as s:
        assert s.get_one(Job, job_id).attempt == MAX_ATTEMPTS + 1


def test_resume_queues_the_job_again_and_keeps_the_pause_off_the_clock(
    maker: sessionmaker[Session]
) -> None:
    now = utcnow()
    job_id = add_job(maker, JobStatus.paused, attempt=1, pauses=1, queued_at=now,
                     started_at=now - timedelta(hours=2), paused_at=now - timedelta(hours=1),
                     paused_seconds=30.0)
    with maker.begin() as s:
        assert jobstate.resume(s, job_id, now=now)
    with maker() as s:
        job = s.get_one(Job, job_id)
        assert (job.status, job.queued_at, job.paused_at) == (JobStatus.queued, now, None)
        assert (job.attempt, job.pauses, job.paused_seconds) == (1, 1, 3630.0)
    (event,) = state(maker, job_id)[1]
    assert event.data == {"status": "queued", "previous": "paused", "reason": "resumed",
                          "paused_seconds": 3600.0}


def test_a_pause_before_the_first_start_is_not_taken_off_the_clock(
    maker: sessionmaker[Session]
) -> None:
    # The time limit counts from the first start: a job paused while still queued owes
    # nothing to it.
    job_id = add_job(maker, JobStatus.queued)
    with maker.begin() as s:
        assert jobstate.request_pause(s, job_id, previous=JobStatus.queued,
                                      now=utcnow() - timedelta(hours=1))
    with maker.begin() as s:
        assert jobstate.resume(s, job_id, now=utcnow())
    with maker() as s:
        assert s.get_one(Job, job_id).paused_seconds == 0.0
