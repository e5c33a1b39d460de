"""Claim: the guarded queued -> running transition that makes a queued job this worker's
run, with the GPUs (or CPU slot) the scheduler placed it on, and the guard every later
write of that run carries.

``claim_next`` is what a worker does on a doorbell: one scheduling decision
(core/jobs/scheduler.py) and, in the same transaction, the claim and the allocation rows.
``claim_job`` claims one named job without a placement (the low-level move)."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, select
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from core.db.models import GpuAllocation, Job, JobEvent, JobStatus, utcnow
from core.db.session import after_commit, session_scope
from core.infra.settings import Settings, get_settings
from core.jobs import queue_load, scheduler, serving_plan
from core.jobs import state as jobstate
from core.policy.fleet import fleet_refusal
from core.policy.slurm import SlurmPool, pool_from_settings, runs_on_slurm
from core.spec import JobSpec, stored_spec_error
from worker.serve import claim as serve_claim

log = logging.getLogger(__name__)


def worker_identity(settings: Settings | None = None) -> str:
    settings = settings or get_settings()
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Claim:
    job_id: str
    tenant_id: str
    worker_id: str
    attempt: int
    # The stored spec, parsed once here (core/jobs/scheduler.py ``specs_of``); None: it no longer
    # parses (a field removed since it was queued), and ``spec_error`` says why.
    spec: JobSpec | None
    started_at: datetime
    paused_seconds: float = 0.0  # time spent paused since started_at: outside the time limit
    # Where the scheduler placed it: physical GPU indices on this worker (the job sees only
    # these), or the CPU slot it holds; neither for a claim made by claim_job.
    gpu_ids: tuple[int, ...] = ()
    cpu_slot: int | None = None
    cpu_slots: int = 1  # slots of this worker: a CPU job gets cores / cpu_slots
    spec_error: str = ""


def claim_job(job_id: str, worker_id: str, *, max_attempts: int) -> Claim | None:
    """queued -> running for exactly one caller. None when the job is not (or no longer)
    this worker's to run: duplicate delivery, already running elsewhere, finished,
    cancelled, or out of attempts (then it is failed with worker_lost here)."""
    with session_scope() as s:
        return _claim_in(s, job_id, worker_id, max_attempts=max_attempts, now=utcnow())


def _claim_in(s: Session, job_id: str, worker_id: str, *, max_attempts: int,
              now: datetime, resized: dict[str, Any] | None = None) -> Claim | None:
    """``resized``: the scheduler starts the job on another process count than its own
    (``scheduler.resized_event``): the run gets that layout, and the event says why."""
    processes = resized["data"]["world_size"]["to"] if resized else None
    claimed = jobstate.claim(s, job_id, worker_id=worker_id, max_attempts=max_attempts, now=now,
                             processes=processes)
    job = s.get(Job, job_id, populate_existing=True)
    if job is None:
        log.warning("job %s: no such job; message dropped", job_id)
        return None
    if claimed:
        assert job.started_at is not None
        spec = queue_load.specs_of(s, {job.id: job.queued_at})[job.id]
        if spec is not None and resized is not None and processes is not None:
            # This run's layout only: the stored spec keeps its own count for later attempts.
            spec = spec.model_copy(update={"distributed": spec.distributed.on(processes)})
            s.add(JobEvent(job_id=job.id, type="resized", created_at=now,
                           message=resized["message"],
                           data={**resized["data"], "attempt": job.attempt}))
        return Claim(job.id, job.tenant_id, worker_id, job.attempt, spec, job.started_at,
                     paused_seconds=float(job.paused_seconds or 0.0),
                     spec_error="" if spec is not None else stored_spec_error(job.spec))
    if job.status == JobStatus.queued and job.cancel_requested_at is not None:
        jobstate.honour_cancel_queued(s, job_id, now=now)
    elif job.status == JobStatus.queued and not jobstate.has_attempts_left(
            job.attempt, job.pauses, max_attempts):
        paused = f", {job.pauses} more ended by a pause" if job.pauses else ""
        msg = (f"gave up after {jobstate.attempts_used(job.attempt, job.pauses)} attempts{paused} "
               f"(max_attempts={max_attempts})")
        # Why the last attempt ended, when its worker said (a rank killed from outside, a
        # worker that shut down): what the user can act on.
        last = s.scalars(select(JobEvent).where(
            JobEvent.job_id == job_id, JobEvent.type == "requeued"
        ).order_by(JobEvent.id.desc()).limit(1)).first()
        if last is not None and (last.data or {}).get("attempt") == job.attempt:
            msg = f"{msg}; the last ended: {last.message}"
        jobstate.give_up(s, job_id, max_attempts=max_attempts, now=now, message=msg)
    else:
        log.info("job %s is %s (worker %s); not claimed", job_id, job.status, job.worker_id)
    return None


def claim_next(settings: Settings, worker_id: str, *, own_bell: bool = False) -> Claim | None:
    """The job this worker runs next, claimed with its GPUs, or None (nothing fits here
    now). A submission's doorbell may reach any worker: when nothing fits here, the workers
    that could start something get a doorbell.

    ``own_bell``: the doorbell was rung for this worker alone, because it had room
    (``ring_worker``). If it has none any more, another decision used it: the claim stops at
    once, without taking the decision lock, and forwards nothing (forwarding would ring
    workers whose room is being filled too, and their empty decisions would ring again)."""
    from worker.upkeep.registry import ensure_registered

    pool = pool_from_settings(settings)
    if pool is not None:
        ensure_registered(settings, worker_id)
    elif own_bell:
        with session_scope() as s:
            if not _may_have_room(s, settings, worker_id):
                return None
    for _ in range(5):
        try:
            with session_scope() as s:
                if pool is not None:
                    return _claim_for_pool(s, settings, worker_id, pool)
                return _decide_and_claim(s, settings, worker_id, forward=not own_bell)
        except (IntegrityError, OperationalError):
            # An allocation row taken meanwhile (should not happen under the decision lock,
            # but the primary key is what guarantees it) or a serialisation failure: the
            # whole decision rolled back; decide again on fresh state.
            log.warning("claim on %s rolled back; deciding again", worker_id, exc_info=True)
    return None


def _may_have_room(s: Session, settings: Settings, worker_id: str) -> bool:
    """False when this worker has no free GPU (or CPU slot) or no free slot now: a read of
    its own row and allocations, much smaller than a decision's."""
    views, _ = queue_load.load_workers(s, settings, utcnow(), only=worker_id)
    w = views.get(worker_id)
    return w is None or not w.fresh or scheduler.has_room(w)  # (None, stale: register first)


def _claim_for_pool(s: Session, settings: Settings, worker_id: str,
                    pool: SlurmPool) -> Claim | None:
    """A pool worker (SLURM) hands jobs to its cluster, which allocates the nodes and GPUs
    and orders its own queue: it claims the first queued job, in queue order, that goes to
    that pool (``runs_on_slurm``), with no allocation rows here. Local workers never place
    such jobs (core/jobs/scheduler.py ``takes_jobs``)."""
    queue_load.lock_decisions(s)
    now = utcnow()
    for c in queue_load.load_state(s, settings, now).queue:
        if c.spec is None or not runs_on_slurm(c.spec, pool):
            continue
        # A cancelled or out-of-attempts job is settled by the claim and gives None.
        claim = _claim_in(s, c.id, worker_id, max_attempts=settings.max_attempts, now=now)
        if claim is not None:
            return claim
    return None


def _decide_and_claim(s: Session, settings: Settings, worker_id: str, *,
                      forward: bool = True) -> Claim | None:
    from worker.upkeep.registry import ensure_registered_in

    queue_load.lock_decisions(s)
    if not forward and not _may_have_room(s, settings, worker_id):
        return None  # several doorbells for the same room: an earlier decision used it
    now = utcnow()
    state = queue_load.load_state(s, settings, now)
    me = state.workers.get(worker_id)
    if me is None or not me.fresh:
        # Not registered yet, marked lost, or a heartbeat gone stale: the worker asking is
        # alive. (Otherwise its heartbeat thread keeps the row fresh: no write here.)
        ensure_registered_in(s, settings, worker_id)
        state = queue_load.load_state(s, settings, now)
    fleet = [w.inv for w in state.workers.values() if w.fresh]
    kept = []
    for c in state.queue:
        if c.cancel_requested or not jobstate.has_attempts_left(
                c.attempt, c.pauses, settings.max_attempts) or c.spec is None or (
                not settings.queue_unrunnable and all(
                    v.spec is None or fleet_refusal(v.spec, fleet) is not None
                    for v in scheduler.variants(c))):
            # Settled here, not placed: cancelled, out of attempts, or claimed without GPUs
            # so that the run fails it with the reason: a spec that no longer parses, or one
            # no registered worker could ever run (admitted while the fleet was empty).
            claim = _claim_in(s, c.id, worker_id, max_attempts=settings.max_attempts, now=now)
            if claim is not None:
                return claim
            continue
        kept.append(c)
    state.queue = kept
    planned = scheduler.plan(state, settings, now)  # one plan: the decision and the bells
    placement = scheduler.decide(state, worker_id, settings, now, planned)
    if placement is None:
        # Idle deployments give their GPUs to a job of higher priority that fits nowhere:
        # once stopped, their GPUs free and the workers with work are rung.
        stop = serving_plan.yields(state, serve_claim.idle_deployments(s, settings), settings,
                                   now)
        if stop:
            serve_claim.stop_to_yield(s, stop, settings)
        if forward:
            others = [w for w in scheduler.workers_with_work(state, settings, now, planned)
                      if w != worker_id]
            if others:
                after_commit(s, lambda: _ring(others))
        return None
    chosen = next(c for c in state.queue if c.id == placement.job_id)
    claim = _claim_in(s, placement.job_id, worker_id, max_attempts=settings.max_attempts,
                      now=now, resized=scheduler.resized_event(chosen, placement, worker_id))
    if claim is None:
        return None
    s.add_all(GpuAllocation(worker_id=worker_id, gpu_index=i, job_id=claim.job_id,
                            attempt=claim.attempt, allocated_at=now)
              for i in placement.allocation_indices)
    s.flush()  # a double-booked GPU fails here, and the claim rolls back with it
    # GPUs freed together fill together: if this worker would start another job once this
    # one holds its GPUs (4 GPUs came free, this job took 1), it rings itself again; each
    # doorbell is one decision, and the next one looks at the state this one commits.
    scheduler.place(state, worker_id, placement, settings, now)
    if scheduler.decide(state, worker_id, settings, now) is not None:
        after_commit(s, lambda: _ring([worker_id]))
    worker = state.workers[worker_id]
    return replace(claim, gpu_ids=tuple(placement.gpu_ids), cpu_slot=placement.cpu_slot,
                   cpu_slots=worker.inv.slots)


def log_unclaimed(job_id: str) -> None:
    """Why the doorbell of ``job_id`` started nothing here: a duplicate (the job runs or
    ran), a job that no longer exists, or one waiting for room."""
    with session_scope() as s:
        job = s.get(Job, job_id)
        if job is None:
            log.warning("job %s: no such job; message dropped", job_id)
        else:
            log.info("job %s is %s (worker %s); not claimed", job_id, job.status, job.worker_id)


def ring_workers_with_work(settings: Settings) -> None:
    """After capacity was freed (a run ended): a doorbell for each worker that would start
    a job now, this one included."""
    with session_scope() as s:
        now = utcnow()
        found = scheduler.workers_with_work(queue_load.load_state(s, settings, now), settings,
                                            now)
    _ring(found)


def _ring(worker_ids: list[str]) -> None:
    from core.jobs.dispatch import ring_worker

    for wid in worker_ids:
        try:
            ring_worker(wid)
        except Exception:
            log.warning("could not ring worker %s; the reconciler re-sends waiting jobs",
                        wid, exc_info=True)


def holder(claim: Claim) -> jobstate.Holder:
    """Who the state machine lets finish, requeue or mark cancelling this job."""
    return jobstate.Holder(claim.worker_id, claim.attempt)


def held_by(claim: Claim) -> list[ColumnElement[bool]]:
    """Guards every write a run makes once the job is claimed: still this worker's attempt,
    still active."""
    return [Job.worker_id == claim.worker_id, Job.attempt == claim.attempt,
            Job.status.in_(jobstate.HELD)]
