"""The job state machine: the only code that writes ``jobs.status``, for the API and the
worker alike.

Every move is a named transition in MOVES. Each one is a guarded UPDATE plus a "status"
event row, in the caller's transaction: the WHERE clause states what the writer believes
(the job's status, its attempt, the worker holding it, a stale heartbeat); if another
process changed the job first, the UPDATE matches no row and the writer does nothing. That
is what makes duplicate deliveries, concurrent reconcilers, a cancel racing a claim and a
worker that lost its job harmless. The status part of every guard comes from MOVES itself,
so a job whose status is not a source of the move is never moved, whatever the caller saw.
A move that happens also writes its webhook event (core/webhooks/outbox.py) in the same
transaction.

Each move (and each new job) also counts in ``job_status_counts``, in the same transaction
(``_count_move``): /metrics reads those few rows instead of counting the history.

A job's GPU allocations (core/db/models.py ``GpuAllocation``) are deleted by the move that
takes it out of running/cancelling, in the same transaction: cancel, timeout, requeue, a
lost worker and a finished run free exactly that job's GPUs, whoever makes the move.

A requeue keeps ``attempt``: the next claim increments it, and a claim at max_attempts
gives the job up instead. An attempt that ended in a pause the user asked for is counted in
``pauses`` and left out of that budget: a claim needs ``attempt - pauses < max_attempts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, delete, func, literal, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core.db.models import (
    GpuAllocation,
    Job,
    JobEvent,
    JobStatus,
    JobStatusCount,
    UTCDateTime,
    utcnow,
)
from core.db.session import execute_rowcount
from core.infra.errors import ErrorCode
from core.jobs.usage import close_attempt, open_attempt, spec_processes
from core.webhooks import outbox


class RunOutcome(StrEnum):
    """How a worker's doorbell ended when it did not end the job itself (otherwise it
    returns the job's new JobStatus)."""

    skipped = "skipped"  # nothing was claimed: no job fits this worker's free slots now
    lost = "lost"  # this worker no longer holds the attempt: the reconciler gave it away


class StopReason(StrEnum):
    """Why a worker stopped a running trainer (the watch loop, local or on SLURM); the
    verdict reads it before the trainer's own outcome."""

    cancel = "cancel"
    pause = "pause"
    timeout = "timeout"
    shutdown = "shutdown"  # the worker is shutting down: the job goes back to the queue
    lost = "lost"  # no longer held: stopped at once, nothing more is written


# Derived facts about a status or an attempt count: the one definition every caller uses.
# A job is finished in one of these; no move leaves them.
FINISHED = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
# A worker holds the job while it is in one of these: it heart-beats it, ingests its events,
# and its attempt holds the processes, so the GPUs (allocation rows) and the usage row
# (core/jobs/usage.py); every move out of them frees both.
HELD = frozenset({JobStatus.running, JobStatus.cancelling, JobStatus.pausing})
# Not finished: the job may still run, so it may still read its files.
UNFINISHED = frozenset(JobStatus) - FINISHED


def is_finished(status: str) -> bool:
    return status in FINISHED


def attempts_used(attempt: Any, pauses: Any) -> Any:
    """Attempts that count against max_attempts: those that ended in a pause the user asked
    for do not. Works on numbers and on the SQL columns (``Job.attempt``, ``Job.pauses``)."""
    return attempt - pauses


def has_attempts_left(attempt: int, pauses: int, max_attempts: int) -> bool:
    """Whether one more claim is within the retry budget."""
    return bool(attempts_used(attempt, pauses) < max_attempts)


def lost_status(status: str, *, cancel_requested: bool, attempt: int, pauses: int,
                max_attempts: int) -> JobStatus:
    """Where a job goes when the worker holding it is lost: a cancel is honoured, a pause
    is kept, otherwise it is requeued while attempts are left, else failed."""
    if status == JobStatus.cancelling or cancel_requested:
        return JobStatus.cancelled
    if status == JobStatus.pausing:
        return JobStatus.paused
    if has_attempts_left(attempt, pauses, max_attempts):
        return JobStatus.queued
    return JobStatus.failed


class Move(StrEnum):
    queue = "queue"
    claim = "claim"
    give_up = "give_up"
    request_cancel = "request_cancel"
    honour_cancel = "honour_cancel"
    finish = "finish"
    requeue = "requeue"
    lose = "lose"
    request_pause = "request_pause"
    pause = "pause"
    resume = "resume"


_Q, _R, _C = JobStatus.queued, JobStatus.running, JobStatus.cancelling
_S, _F, _X = JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled
_PG, _PD = JobStatus.pausing, JobStatus.paused

# (from, move, to). Who moves, and on what guard, is in the function of the same name.
MOVES: frozenset[tuple[JobStatus | None, Move, JobStatus]] = frozenset({
    (None, Move.queue,          _Q),  # API: a validated job is recorded
    (_Q,   Move.claim,          _R),  # worker: attempt < max, no cancel requested
    (_Q,   Move.give_up,        _F),  # worker: claimed at max_attempts (worker_lost)
    (_Q,   Move.request_cancel, _X),  # API: a queued job is cancelled at once
    (_R,   Move.request_cancel, _C),  # API: a running one is stopped by its worker
    (_Q,   Move.honour_cancel,  _X),  # claim / reconciler: queued with a cancel requested
    (_R,   Move.honour_cancel,  _C),  # worker: saw the cancel request while running
    (_R,   Move.finish,         _S),  # worker holding the attempt: the run's outcome
    (_R,   Move.finish,         _F),
    (_R,   Move.finish,         _X),
    (_C,   Move.finish,         _S),
    (_C,   Move.finish,         _F),
    (_C,   Move.finish,         _X),
    (_R,   Move.requeue,        _Q),  # worker holding the attempt: it shuts down
    (_C,   Move.requeue,        _Q),
    (_R,   Move.lose,           _Q),  # reconciler, heartbeat stale: attempts left
    (_R,   Move.lose,           _F),  # no attempts left (worker_lost)
    (_R,   Move.lose,           _X),  # cancel requested
    (_C,   Move.lose,           _X),
    (_Q,   Move.request_pause,  _PD),  # API: a queued job is paused at once
    (_R,   Move.request_pause,  _PG),  # API: a running one is stopped at a checkpoint
    (_PG,  Move.pause,          _PD),  # worker holding it: the tree is gone, checkpoint saved
    (_PD,  Move.resume,         _Q),   # API: queued again; resumes from its checkpoint
    (_PD,  Move.request_cancel, _X),   # API: a paused job holds no worker: cancelled at once
    (_PG,  Move.request_cancel, _C),   # API: cancel wins over a pause still being enforced
    (_PG,  Move.finish,         _S),   # worker: the run ended before it could pause
    (_PG,  Move.finish,         _F),
    (_PG,  Move.lose,           _PD),  # reconciler: a pausing job's worker is gone
})


class IllegalMove(ValueError):
    """A move not in MOVES: a bug in the caller, never a race (races return False)."""


def sources(move: Move, to: JobStatus) -> frozenset[JobStatus]:
    """The statuses ``move`` may take a job from to reach ``to``."""
    return frozenset(f for f, m, t in MOVES if m == move and t == to and f is not None)


def target(previous: JobStatus | str, move: Move) -> JobStatus:
    """Where ``move`` takes a job from ``previous``, when that is one status."""
    found = {t for f, m, t in MOVES if f == previous and m == move}
    if len(found) != 1:
        raise IllegalMove(f"{move} from {previous}: {'ambiguous' if found else 'not allowed'}")
    return found.pop()


@dataclass(frozen=True)
class Holder:
    """The worker attempt that holds a running job; its writes are guarded by both."""

    worker_id: str
    attempt: int

    def guard(self) -> list[ColumnElement[bool]]:
        return [Job.worker_id == self.worker_id, Job.attempt == self.attempt]


def _status_event(job_id: str, to: str, previous: str | None, created_at: datetime | None,
                  **data: Any) -> JobEvent:
    msg = f"{previous} -> {to}" if previous else to
    if data.get("error_code"):
        msg += f" ({data['error_code']})"
    event = JobEvent(job_id=job_id, type="status", message=msg,
                     data={"status": str(to), "previous": previous,
                           **{k: v for k, v in data.items() if v is not None}})
    if created_at is not None:
        event.created_at = created_at
    return event


def _move(session: Session, job_id: str, move: Move, *, previous: str, to: JobStatus,
          guard: list[ColumnElement[bool]], values: dict[str, Any] | None = None,
          event_data: dict[str, Any] | None = None, at: datetime | None = None,
          attempt_ended_at: datetime | None = None) -> bool:
    """The one UPDATE of ``jobs.status``. IllegalMove if (previous, move, to) is not in
    MOVES; False (and nothing written) if the job is no longer in a source status of the
    move or ``guard`` no longer holds."""
    if (previous, move, to) not in MOVES:
        raise IllegalMove(f"{previous} -> {to} by {move} is not a job state move")
    # The status it moves from must be known, to count it out (``_count_move``): the UPDATE
    # says only whether it matched, so it is guarded by one source at a time, the caller's
    # belief first. A move allowed from several sources whose job moved meanwhile to
    # another of them (a cancel turned running into cancelling just before the worker's
    # finish) is tried again from the status the job now has.
    tried: set[str] = set()
    source: str | None = previous
    while source is not None and source in sources(move, to) and source not in tried:
        tried.add(source)
        n = execute_rowcount(
            session,
            update(Job)
            .where(Job.id == job_id, Job.status == source, *guard)
            .values(status=to, **(values or {}))
            .execution_options(synchronize_session=False),
        )
        if n == 1:
            break
        source = session.scalar(select(Job.status).where(Job.id == job_id))
    else:
        return False
    assert source is not None
    previous = source
    _count_move(session, job_id, previous, to)
    if to not in HELD:
        # The job's processes are gone (or never started): its GPUs are free.
        session.execute(delete(GpuAllocation).where(GpuAllocation.job_id == job_id)
                        .execution_options(synchronize_session=False))
    session.add(_status_event(job_id, to, previous, at, **(event_data or {})))
    # The webhook outbox row commits (or rolls back) with the move itself.
    outbox.job_status_changed(session, job_id, to, move)
    if previous in HELD and to not in HELD:
        # Whatever ended the attempt (finish, requeue, lost, and any later move out of a
        # running status): its usage stops here, in the same transaction.
        close_attempt(session, job_id, ended_at=attempt_ended_at or at or utcnow())
    return True


# --------------------------------------------------------------------------- counts
# One row per status would be a hot spot on PostgreSQL: the row lock a move takes on it is
# held until the move's transaction commits, so every move into or out of one status (each
# submission goes into queued, each claim out of it) would wait for the one before it to
# commit, one at a time, fsync included. So each status has a row per last character of
# the job id (ids end in a random hex digit: 16 rows a status, ``shard_of``): two moves wait
# for each other only when their jobs share that digit (1 in 16). Every move of a job lands
# on its own shard's rows, so each row is an exact count of its jobs, never negative, and a
# recount can check them row by row. A move's two rows are written by one statement in
# status order, so two moves never lock the same two rows in opposite orders. (Deltas
# appended per move would not contend at all, but would need compacting, or a scrape reads
# the history again.) On SQLite every write holds the database lock anyway.


def shard_of(job_id: str) -> str:
    """The ``job_status_counts`` row a job counts in, besides its status."""
    return job_id[-1:]


def _count_move(session: Session, job_id: str, previous: str | None, to: str) -> None:
    deltas = {str(to): 1} | ({str(previous): -1} if previous is not None else {})
    insert = (postgresql.insert if session.get_bind().dialect.name == "postgresql"
              else sqlite.insert)
    stmt = insert(JobStatusCount).values(
        [{"status": s, "shard": shard_of(job_id), "jobs": d} for s, d in sorted(deltas.items())])
    session.execute(stmt.on_conflict_do_update(
        index_elements=["status", "shard"], set_={"jobs": JobStatusCount.jobs + stmt.excluded.jobs}))


def counts_by_status(session: Session) -> dict[str, int]:
    """Jobs in each status, from the kept counts (at most 16 rows a status)."""
    rows = session.execute(select(JobStatusCount.status, func.sum(JobStatusCount.jobs))
                           .group_by(JobStatusCount.status)).all()
    return {status: int(n) for status, n in rows if n}


def recount_by_status(session: Session) -> dict[str, int]:
    """What ``counts_by_status`` keeps, counted from the jobs themselves (reads every job:
    for checks, not for requests)."""
    rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
    return {status: int(n) for status, n in rows if n}


# --------------------------------------------------------------------------- API


def queue(session: Session, job: Job, *, now: datetime, event_data: dict[str, Any]) -> None:
    """A new, validated job: inserted as queued with its first "status" event. Flushes, so
    a unique-key conflict (the same Idempotency-Key) raises here."""
    assert (None, Move.queue, JobStatus.queued) in MOVES
    job.status = JobStatus.queued
    job.queued_at = now
    session.add(job)
    session.flush()  # the job row first: the event refers to it
    session.add(JobEvent(job_id=job.id, type="status", message=str(JobStatus.queued),
                         created_at=now,
                         data={"status": str(JobStatus.queued), "previous": None, **event_data}))
    session.flush()
    _count_move(session, job.id, None, JobStatus.queued)


def request_cancel(session: Session, job_id: str, *, previous: str, now: datetime) -> bool:
    """A user's cancel: records the request, and moves the job as MOVES says (queued or
    paused -> cancelled, running or pausing -> cancelling). Raises IllegalMove from any
    other status."""
    to = target(previous, Move.request_cancel)
    values: dict[str, Any] = {"cancel_requested_at": now}
    if to == JobStatus.cancelled:
        values["finished_at"] = now
    return _move(session, job_id, Move.request_cancel, previous=previous, to=to,
                 guard=[Job.status == previous], values=values,
                 event_data={"reason": "cancel requested"}, at=now)


def request_pause(session: Session, job_id: str, *, previous: str, now: datetime) -> bool:
    """A user's pause: queued -> paused at once (no worker holds it), running -> pausing
    (its worker stops the trainer at a checkpoint). Raises IllegalMove from any other
    status."""
    to = target(previous, Move.request_pause)
    values = {"paused_at": now} if to == JobStatus.paused else None
    return _move(session, job_id, Move.request_pause, previous=previous, to=to,
                 guard=[Job.status == previous], values=values,
                 event_data={"reason": "pause requested"}, at=now)


def resume(session: Session, job_id: str, *, now: datetime) -> bool:
    """paused -> queued; the caller enqueues it after the commit. The next claim (on any
    worker) resumes from the latest checkpoint, as after any earlier attempt. The time it
    spent paused after it first started is added to ``paused_seconds`` (compare-and-set on
    ``paused_at``), so the job's time limit does not run while it is paused."""
    row = session.execute(select(Job.paused_at, Job.started_at).where(Job.id == job_id)).first()
    if row is None:
        return False
    paused_for = 0.0
    if row.paused_at is not None and row.started_at is not None:
        paused_for = max((now - row.paused_at).total_seconds(), 0.0)
    same_pause = (Job.paused_at.is_(None) if row.paused_at is None
                  else Job.paused_at == row.paused_at)
    return _move(session, job_id, Move.resume, previous=JobStatus.paused, to=JobStatus.queued,
                 guard=[same_pause],
                 values={"queued_at": now, "paused_at": None,
                         "paused_seconds": Job.paused_seconds + paused_for},
                 event_data={"reason": "resumed", "paused_seconds": round(paused_for, 3)},
                 at=now)


# --------------------------------------------------------------------------- worker


def _now_param(now: datetime) -> Any:
    return literal(now, type_=UTCDateTime())


def claim(session: Session, job_id: str, *, worker_id: str, max_attempts: int,
          now: datetime, processes: int | None = None) -> bool:
    """queued -> running for exactly one caller; the attempt counter moves on, and its
    usage row opens (``processes``: the run's, when the scheduler chose another count than
    the spec's)."""
    claimed = _move(
        session, job_id, Move.claim, previous=JobStatus.queued, to=JobStatus.running,
        guard=[Job.cancel_requested_at.is_(None),
               attempts_used(Job.attempt, Job.pauses) < max_attempts],
        values={
            "worker_id": worker_id,
            "attempt": Job.attempt + 1,
            "started_at": func.coalesce(Job.started_at, _now_param(now)),
            "heartbeat_at": now,
            "finished_at": None,
            "error_code": None,
            "error_message": None,
        },
        event_data={"worker_id": worker_id},
    )
    if claimed:
        attempt, spec = session.execute(
            select(Job.attempt, Job.spec).where(Job.id == job_id)
        ).one()
        open_attempt(session, job_id, attempt=attempt, worker_id=worker_id, started_at=now,
                     processes=processes or spec_processes(spec))
    return claimed


def give_up(session: Session, job_id: str, *, max_attempts: int, now: datetime,
            message: str) -> bool:
    """queued -> failed (worker_lost): every attempt was used."""
    return _move(
        session, job_id, Move.give_up, previous=JobStatus.queued, to=JobStatus.failed,
        guard=[attempts_used(Job.attempt, Job.pauses) >= max_attempts],
        values={"finished_at": now, "worker_id": None, "error_code": ErrorCode.worker_lost,
                "error_message": message},
        event_data={"error_code": ErrorCode.worker_lost},
    )


def honour_cancel_queued(session: Session, job_id: str, *, now: datetime) -> bool:
    """queued -> cancelled, for a queued job whose cancel was requested."""
    return _move(session, job_id, Move.honour_cancel, previous=JobStatus.queued,
                 to=JobStatus.cancelled, guard=[Job.cancel_requested_at.is_not(None)],
                 values={"finished_at": now, "worker_id": None})


def honour_cancel_running(session: Session, job_id: str, holder: Holder) -> bool:
    """running -> cancelling, by the worker holding the job when it sees the request."""
    return _move(session, job_id, Move.honour_cancel, previous=JobStatus.running,
                 to=JobStatus.cancelling, guard=holder.guard())


def finish(session: Session, job_id: str, holder: Holder, *, previous: str, to: JobStatus,
           now: datetime, error_code: str | None = None, error_message: str | None = None,
           adapter_path: str | None = None) -> bool:
    """running | cancelling | pausing -> succeeded | failed | cancelled, by the worker
    holding it."""
    return _move(
        session, job_id, Move.finish, previous=previous, to=to, guard=holder.guard(),
        values={"finished_at": now, "heartbeat_at": now, "error_code": error_code,
                "error_message": error_message, "adapter_path": adapter_path},
        event_data={"error_code": error_code, "attempt": holder.attempt}, at=now,
    )


def requeue(session: Session, job_id: str, holder: Holder, *, previous: str, why: str,
            now: datetime) -> bool:
    """running | cancelling -> queued, by the worker holding it (it shuts down)."""
    return _move(
        session, job_id, Move.requeue, previous=previous, to=JobStatus.queued,
        guard=holder.guard(),
        values={"worker_id": None, "heartbeat_at": None, "queued_at": now},
        event_data={"reason": why, "attempt": holder.attempt}, at=now,
    )


def pause(session: Session, job_id: str, holder: Holder, *, now: datetime,
          checkpoint_step: int | None) -> bool:
    """pausing -> paused, by the worker holding it once every process of the run is gone.
    The attempt is counted in ``pauses``, so it does not use up the attempt budget."""
    return _move(
        session, job_id, Move.pause, previous=JobStatus.pausing, to=JobStatus.paused,
        guard=holder.guard(),
        values={"worker_id": None, "heartbeat_at": None, "pauses": Job.pauses + 1,
                "paused_at": now},
        event_data={"attempt": holder.attempt, "checkpoint_step": checkpoint_step},
        at=now,
    )


# --------------------------------------------------------------------------- reconciler


def lose(session: Session, job_id: str, *, previous: str, attempt: int, to: JobStatus,
         stale_before: datetime, now: datetime, message: str) -> bool:
    """A job whose worker stopped heart-beating (or that no worker holds): queued again,
    failed (worker_lost), cancelled or (it was pausing) paused, only while its heartbeat is
    still older than ``stale_before`` and its attempt is still ``attempt``. A lost pausing
    attempt stays counted against the budget: its worker, not the user, ended it."""
    values: dict[str, Any]
    event_data: dict[str, Any]
    if to == JobStatus.queued:
        values = {"worker_id": None, "heartbeat_at": None, "queued_at": now}
        event_data = {"reason": message}
    elif to == JobStatus.paused:
        values = {"worker_id": None, "heartbeat_at": None, "paused_at": now}
        event_data = {"reason": message}
    elif to == JobStatus.failed:
        values = {"finished_at": now, "worker_id": None, "error_code": ErrorCode.worker_lost,
                  "error_message": message}
        event_data = {"error_code": ErrorCode.worker_lost}
    else:
        values = {"finished_at": now, "worker_id": None}
        event_data = {"reason": message}
    stale = or_(Job.heartbeat_at < stale_before, Job.heartbeat_at.is_(None),
                Job.worker_id.is_(None))
    # The attempt's usage ends at its last sign of life (a heartbeat, or an event of the
    # trainer's that reached the database), not when the loss is noticed.
    signs = [session.scalar(select(Job.heartbeat_at).where(Job.id == job_id)),
             session.scalar(select(func.max(JobEvent.created_at))
                            .where(JobEvent.job_id == job_id, JobEvent.type != "status"))]
    seen = [t for t in signs if t is not None]
    return _move(session, job_id, Move.lose, previous=previous, to=to,
                 guard=[Job.status == previous, Job.attempt == attempt, stale],
                 values=values, event_data=event_data, at=now,
                 attempt_ended_at=min(max(seen), now) if seen else None)
