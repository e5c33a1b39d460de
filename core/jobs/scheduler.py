"""The queue: which queued job a worker with free GPUs (or CPU slots) runs next, and why a
queued job waits. The database decides; a broker message only says "look now".

Each decision plans what the whole fleet would start now (``plan``); the worker that asks
takes the first planned start it can hold (``decide``), and the plan says which workers to
ring. The rules:

* Fit: the job's spec passes the worker's inventory (core/policy/fleet.py), and the worker
  has ``distributed.num_processes`` free GPUs (a CPU worker: a free slot) right now. The plan
  puts a job on the worker it fits most tightly (best fit), so that whole workers stay free
  for large jobs and doorbells go there first; a worker that asks may take it all the same
  (it is alive; the one planned may have died a moment ago).
* Tenant limits: a tenant's running jobs and the GPUs they hold stay within its limits
  (settings ``tenant_max_running_jobs`` / ``tenant_max_gpus`` / ``tenant_limits``).
* Order: higher ``priority`` first, then first come first served (``created_at``). A job
  that does not fit now is passed over for one behind it that does (backfill), so GPUs do
  not idle behind a large job...
* ...except that no job starves: reservation, not aging. The first job in queue order that
  has waited ``reserve_after_seconds`` and fits nowhere, once the jobs ahead of it are
  placed, gets one worker reserved for it: the one where it can start soonest, judged by
  the deadlines of the jobs running there (core/policy/limits.py: a run is stopped at its
  time limit and killed ``cancel_grace_seconds`` later, so its GPUs are free by then at the
  latest), or, where a job without a time limit is in the way, the one with the most free
  GPUs. Aging (raising a waiting job's rank) would not help: a high-ranked 8-GPU job still
  never finds 8 free GPUs while 1-GPU jobs keep taking whatever frees up. Only that job
  holds a reservation, and only on one worker, so the rest of the fleet stays busy.
* The reserved worker keeps busy too (EASY backfill): jobs behind the reserved one start
  there only if they cannot delay it: their own time limit ends before the reserved job
  could start anyway (``starts_by``), or they take only GPUs (and a slot) the reserved job
  will not need then (``spare_gpus``). So the reserved job starts by ``starts_by`` at the
  latest (unless a job ahead of it in queue order, one of higher priority or one its
  tenant's limit held back, takes the reservation over), and where no bound is known (a
  running job without a time limit) the worker starts nothing new: its free GPUs only grow
  until the job fits.

* Resume anywhere: a job that continues from a checkpoint (a paused or preempted one) and
  lists other process counts in ``distributed.resume_on`` starts on the largest count
  (its own among them) that fits a GPU worker now and over which the checkpoint's global
  batch splits (core/run/checkpoints.py ``resume_refusal``), rather than wait for its own
  slice (a CPU worker runs a job in one slot whatever its count: there it keeps its own);
  the claim writes a "resized" event saying what it chose and why. Each attempt
  chooses again (the stored spec keeps its own count); reservations are for its own count.

This module is the pure planning: it reads no database. core/jobs/queue_load.py loads the
FleetState it plans on (``load_state``). Decisions are made one at a time (queue_load
``lock_decisions``: a row lock on PostgreSQL, the write lock on SQLite) against the state the
previous one committed, so tenant limits and reservations hold exactly across any number of
workers; a decision reads a few small tables and takes milliseconds. The claim itself stays the guarded move of core/jobs/state.py, and the
GPUs it takes are rows whose primary key (worker, index) no second claim can insert.
"""


from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from core.db.models import WorkerState
from core.infra.settings import Settings
from core.jobs.queue_model import (
    QUEUE_WINDOW,
    Candidate,
    FleetState,
    Holding,
    Placement,
    Reservation,
    Resumable,
    Waiting,
    WorkerView,
    at_count,
    cpu_slot_index,
    free_by,
    hosts_count,
    resized_event,
    resumable,
    variants,
)
from core.policy.fleet import gpus_needed, inventory_refusal

# The queue's data lives in core/jobs/queue_model.py; these names are the planner's too.
__all__ = ["QUEUE_WINDOW", "Candidate", "FleetState", "Holding", "Placement", "Reservation",
           "Resumable", "Waiting", "WorkerView", "at_count", "cpu_slot_index", "free_by",
           "resized_event", "resumable", "variants"]

# --------------------------------------------------------------------------- rules


def runnable_on(c: Candidate, w: WorkerView, state: FleetState | None = None) -> bool:
    if c.spec is None:
        return False
    if state is None:
        return inventory_refusal(c.spec, w.inv) is None
    key = (c.id, c.spec.distributed.processes, w.inv.id)
    found = state.runnable.get(key)
    if found is None:
        found = state.runnable[key] = inventory_refusal(c.spec, w.inv) is None
    return found


def need_of(c: Candidate, w: WorkerView) -> int:
    assert c.spec is not None
    return gpus_needed(c.spec, w.inv)


def has_room(w: WorkerView) -> bool:
    """A free slot, and a free GPU (or CPU slot) for at least the smallest job."""
    if not w.takes_jobs or w.free_slots <= 0:
        return False
    return bool(w.free_cpu_slots) if w.inv.gpus == 0 else bool(w.free_gpus)


def fits_now(c: Candidate, w: WorkerView, state: FleetState | None = None) -> bool:
    if not has_room(w) or not runnable_on(c, w, state):
        return False
    if w.inv.gpus == 0:
        return bool(w.free_cpu_slots)
    return need_of(c, w) <= len(w.free_gpus)


def tenant_block(c: Candidate, state: FleetState, settings: Settings,
                 gpus: int) -> str | None:
    """Why the tenant's limits keep ``c`` waiting (``gpus``: what it would hold), or None."""
    max_jobs = settings.tenant_limit(c.tenant_name, "max_running_jobs")
    running = state.tenant_jobs.get(c.tenant_id, 0)
    if max_jobs is not None and running >= max_jobs:
        return f"the tenant has {running} of its {max_jobs} running jobs"
    max_gpus = settings.tenant_limit(c.tenant_name, "max_gpus")
    held = state.tenant_gpus.get(c.tenant_id, 0)
    if max_gpus is not None and gpus and held + gpus > max_gpus:
        return (f"the tenant's running jobs hold {held} of its {max_gpus} GPUs and this job "
                f"needs {gpus}")
    return None


def eligible(queue: Iterable[Candidate]) -> Iterable[Candidate]:
    return (c for c in queue if not c.cancel_requested and c.spec is not None)


def room_by(w: WorkerView, need: int, now: datetime) -> tuple[datetime | None, int, int]:
    """When worker ``w`` has ``need`` free GPUs and a free slot at the latest, judged by the
    deadlines of the jobs running there, with the GPUs and slots spare then beyond those:
    (``now``, ...) if it has room already, (None, 0, 0) if a job without a time limit is in
    the way."""
    gpus, slots, at = len(w.free_gpus), w.free_slots, now
    ending = sorted(w.holding, key=lambda h: (h.free_by is None, h.free_by or now))
    i = 0
    while gpus < need or slots < 1:
        if i == len(ending) or ending[i].free_by is None:
            return None, 0, 0
        at = max(at, ending[i].free_by or now)
        while i < len(ending) and (free_by := ending[i].free_by) is not None and free_by <= at:
            gpus, slots, i = gpus + ending[i].gpus, slots + 1, i + 1
    return at, gpus - need, slots - 1


def _free_by_if_started(c: Candidate, settings: Settings, now: datetime) -> datetime | None:
    """The latest moment ``c`` would give its GPUs back if it started now (its deadline
    counts from its first start, so an earlier attempt only brings it closer)."""
    return free_by(c.spec, now, 0.0, settings)


def backfills(c: Candidate, need: int, held: Reservation, settings: Settings,
              now: datetime) -> bool:
    """Whether ``c`` (``need`` GPUs) may start on the worker held for ``held`` without
    delaying it: it is stopped before the held job could start anyway, or it takes only
    GPUs and a slot the held job will not need."""
    if held.starts_by is None:
        return False
    ends_by = _free_by_if_started(c, settings, now)
    if ends_by is not None and ends_by <= held.starts_by:
        return True
    return need <= held.spare_gpus and held.spare_slots >= 1


def place(state: FleetState, worker_id: str, p: Placement, settings: Settings,
          now: datetime) -> None:
    """Apply placement ``p`` to ``state`` as its commit would: the job leaves the queue and
    holds its GPUs (or slot) on the worker and in its tenant's counts."""
    w = state.workers[worker_id]
    c = next(c for c in state.queue if c.id == p.job_id)
    state.queue.remove(c)
    w.free_gpus = [g for g in w.free_gpus if g not in p.gpu_ids]
    w.free_cpu_slots = [k for k in w.free_cpu_slots if k != p.cpu_slot]
    w.running += 1
    w.holding = [*w.holding, Holding(c.id, len(p.gpu_ids), _free_by_if_started(c, settings, now))]
    state.tenant_jobs[c.tenant_id] = state.tenant_jobs.get(c.tenant_id, 0) + 1
    state.tenant_gpus[c.tenant_id] = state.tenant_gpus.get(c.tenant_id, 0) + len(p.gpu_ids)


def _copy(state: FleetState) -> FleetState:
    return FleetState(
        {wid: replace(w, free_gpus=list(w.free_gpus), free_cpu_slots=list(w.free_cpu_slots),
                      holding=list(w.holding)) for wid, w in state.workers.items()},
        list(state.queue), dict(state.tenant_jobs), dict(state.tenant_gpus), state.runnable)


@dataclass(frozen=True)
class Plan:
    starts: list[tuple[str, Placement]]  # (worker, placement), in queue order
    held: Reservation | None  # with the backfill planned on its worker counted in
    left: dict[str, WorkerView]  # each worker once the planned starts hold their GPUs


def plan(state: FleetState, settings: Settings, now: datetime) -> Plan:
    """What the whole fleet starts now under the rules (module doc), in queue order: each job
    that may start goes to the worker it fits most tightly (best fit: whole workers stay free
    for large jobs); the first job that has waited reserve_after_seconds and fits nowhere
    once the jobs ahead of it are placed reserves a worker (their deadlines count in its
    bound); jobs behind it start on that worker only as backfill (each one planned there
    counts in the reservation's spare GPUs for the next). ``decide`` takes one start for the
    worker asking; the others say which workers to ring."""
    work = _copy(state)
    starts: list[tuple[str, Placement]] = []
    held: Reservation | None = None
    old = now - timedelta(seconds=settings.reserve_after_seconds)
    for job in list(eligible(work.queue)):
        # Its own process count, or (resuming from a checkpoint) the counts it allows,
        # largest first: the first one that may start now starts.
        tried = variants(job)
        runs: dict[int, tuple[Candidate, list[WorkerView]]] = {}  # count -> workers for it
        placed = False
        for c in tried:
            hosts = [w for w in work.workers.values()
                     if w.takes_jobs and hosts_count(c, w) and runnable_on(c, w, state)]
            if not hosts:
                continue
            assert c.spec is not None
            runs[c.spec.distributed.num_processes] = (c, hosts)
            fit = [w for w in hosts if fits_now(c, w, state)
                   and not tenant_block(c, work, settings, need_of(c, w))
                   and (held is None or w.inv.id != held.worker_id
                        or backfills(c, need_of(c, w), held, settings, now))]
            if fit:
                w = min(fit, key=lambda w: (_spare(c, w), w.inv.id))
                p = _placement(c, w)
                place(work, w.inv.id, p, settings, now)
                starts.append((w.inv.id, p))
                if held is not None and w.inv.id == held.worker_id:
                    held = replace(held, **_room(work.workers[w.inv.id], held.need, now))
                placed = True
                break
        if placed or not runs:
            continue
        # A reservation is for the job's own count where some worker can run it (else the
        # largest count one can): the other counts take whatever fits without one.
        assert job.spec is not None
        c, hosts = runs.get(job.spec.distributed.num_processes) or next(iter(runs.values()))
        if (held is None and c.created_at <= old
                and not any(fits_now(v, w, state) for v in tried for w in work.workers.values()
                            if hosts_count(v, w))
                and not tenant_block(c, work, settings, max(need_of(c, w) for w in hosts))):
            rooms = {w.inv.id: room_by(w, need_of(c, w), now) for w in hosts}
            best = min(hosts, key=lambda w: (rooms[w.inv.id][0] is None,
                                             rooms[w.inv.id][0] or now,
                                             -len(w.free_gpus), w.inv.id))
            held = Reservation(c.id, best.inv.id, need_of(c, best), *rooms[best.inv.id])
    return Plan(starts, held, work.workers)


def _room(w: WorkerView, need: int, now: datetime) -> dict[str, Any]:
    starts_by, spare_gpus, spare_slots = room_by(w, need, now)
    return {"starts_by": starts_by, "spare_gpus": spare_gpus, "spare_slots": spare_slots}


def _spare(c: Candidate, w: WorkerView) -> int:
    """What would stay free on ``w`` if ``c`` started there (GPUs, or CPU slots)."""
    if w.inv.gpus == 0:
        return len(w.free_cpu_slots) - 1
    return len(w.free_gpus) - need_of(c, w)


def decide(state: FleetState, worker_id: str, settings: Settings, now: datetime,
           planned: Plan | None = None) -> Placement | None:
    """The job worker ``worker_id`` starts now, on which GPUs, or None: the first start of
    the plan (queue order) that it can hold: one planned for it, or one planned for another
    worker that fits in what the plan leaves free here (the worker that asks is alive; the
    one planned may have died a moment ago), and on the reserved worker only one that
    cannot delay the reserved job. Either way no planned start loses its GPUs and the
    reservation's bound holds (``plan``). ``planned``: ``plan(state, settings, now)``,
    when the caller has it already."""
    w = state.workers.get(worker_id)
    if w is None or not has_room(w):
        return None
    planned = planned or plan(state, settings, now)
    held, left = planned.held, planned.left[worker_id]
    for wid, p in planned.starts:
        if wid == worker_id:
            return p
        c = at_count(next(c for c in state.queue if c.id == p.job_id), p.processes)
        if not hosts_count(c, left) or not fits_now(c, left, state):
            continue
        if held is not None and held.worker_id == worker_id and \
                not backfills(c, need_of(c, left), held, settings, now):
            continue
        return _placement(c, left)
    return None


def _placement(c: Candidate, w: WorkerView) -> Placement:
    assert c.spec is not None
    processes = c.spec.distributed.num_processes
    if w.inv.gpus == 0:
        return Placement(c.id, [], w.free_cpu_slots[0], processes)
    return Placement(c.id, sorted(w.free_gpus)[:need_of(c, w)], None, processes)


def workers_with_work(state: FleetState, settings: Settings, now: datetime,
                      planned: Plan | None = None) -> list[str]:
    """The workers that would start a job if they looked now: where a doorbell is useful.
    A pool (SLURM) is rung when a queued job only it can run waits: it places the job
    itself. ``planned``: as for ``decide``."""
    planned = planned or plan(state, settings, now)
    found = list(dict.fromkeys(wid for wid, _ in planned.starts))
    pools = [w for w in state.workers.values()
             if w.inv.executor != "local" and w.fresh and w.state == WorkerState.active]
    if pools:
        local = [w for w in state.workers.values() if w.takes_jobs]
        for_pools = [c for c in eligible(state.queue)
                     if not any(runnable_on(v, w, state) for v in variants(c) for w in local)]
        found += [p.inv.id for p in pools
                  if any(runnable_on(c, p, state) for c in for_pools)]
    return found
