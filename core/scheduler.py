"""The queue: which queued job a worker with free GPUs (or CPU slots) runs next, and why a
queued job waits. The database decides; a broker message only says "look now".

Rules, in order (``decide``):

* Fit: the job's spec passes the worker's inventory (core/policy/fleet.py), and the worker
  has ``distributed.num_processes`` free GPUs (a CPU worker: a free slot) right now.
* Tenant limits: a tenant's running jobs and the GPUs they hold stay within its limits
  (settings ``tenant_max_running_jobs`` / ``tenant_max_gpus`` / ``tenant_limits``).
* Order: higher ``priority`` first, then first come first served (``created_at``). A job
  that does not fit now is passed over for one behind it that does (backfill), so GPUs do
  not idle behind a large job...
* ...except that no job starves: reservation, not aging. Once a job has waited
  ``reserve_after_seconds`` and fits on no worker's free GPUs, the worker with the most free
  GPUs among those that could hold it starts nothing new until it fits. Its free GPUs only
  grow (its jobs end, it starts none), so the reserved job starts after at most the longest
  running job there. Aging (raising a waiting job's rank) would not help: a high-ranked
  8-GPU job still never finds 8 free GPUs while 1-GPU jobs keep taking whatever frees up.
  Only the first such job holds a reservation, and only on one worker, so the rest of the
  fleet stays busy.

Decisions are made one at a time (``lock_decisions``: a row lock on PostgreSQL, the write
lock on SQLite) against the state the previous one committed, so tenant limits and
reservations hold exactly across any number of workers; a decision reads a few small tables
and takes milliseconds. The claim itself stays the guarded move of core/jobstate.py, and the
GPUs it takes are rows whose primary key (worker, index) no second claim can insert.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from core.db.models import GpuAllocation, Job, JobStatus, SchedulerLock, Tenant, Worker, WorkerState
from core.jobstate import HOLDS_PROCESSES
from core.policy.fleet import Inventory, fleet_refusal, gpus_needed, inventory_refusal
from core.settings import Settings
from core.spec import JobSpec

QUEUE_WINDOW = 200  # queued jobs a decision looks at, in queue order (how far it backfills)
# A tenant's running jobs, for its limit: those whose processes still hold their GPUs.
ACTIVE = tuple(sorted(s.value for s in HOLDS_PROCESSES))


def cpu_slot_index(slot: int) -> int:
    """CPU slots are allocated like GPUs, at negative indices (-1, -2, ...), under the same
    primary key: a CPU slot is never handed to two jobs either."""
    return -(slot + 1)


@dataclass
class WorkerView:
    inv: Inventory
    state: str
    fresh: bool
    gpu_indices: list[int]
    free_gpus: list[int]
    free_cpu_slots: list[int]
    running: int

    @property
    def takes_jobs(self) -> bool:
        """Open for placements here. A pool with an executor of its own (SLURM) counts for
        admission but places its jobs itself."""
        return self.state == WorkerState.active and self.fresh and self.inv.executor == "local"

    @property
    def free_slots(self) -> int:
        return self.inv.slots - self.running


@dataclass
class Candidate:
    id: str
    tenant_id: str
    tenant_name: str
    priority: int
    created_at: datetime
    attempt: int
    pauses: int  # attempts that ended in a pause: outside the attempt budget
    cancel_requested: bool
    spec: JobSpec | None  # None: the stored spec no longer parses (the claim fails it)


@dataclass
class FleetState:
    workers: dict[str, WorkerView]
    queue: list[Candidate]
    tenant_jobs: dict[str, int] = field(default_factory=dict)
    tenant_gpus: dict[str, int] = field(default_factory=dict)
    # (job, worker) -> whether the worker's inventory can run the job: asked for every
    # candidate on every worker, and the answer does not change within a decision.
    runnable: dict[tuple[str, str], bool] = field(default_factory=dict)

    def inventories(self) -> list[Inventory]:
        return [w.inv for w in self.workers.values() if w.state != WorkerState.lost]


@dataclass(frozen=True)
class Placement:
    job_id: str
    gpu_ids: list[int]  # physical indices on the worker; [] on a CPU worker
    cpu_slot: int | None  # the CPU slot taken (CPU workers)

    @property
    def allocation_indices(self) -> list[int]:
        if self.cpu_slot is not None:
            return [cpu_slot_index(self.cpu_slot)]
        return list(self.gpu_ids)


@dataclass(frozen=True)
class Waiting:
    position: int  # jobs ahead of it in queue order
    waiting_for: str  # worker | gpus | tenant_limit | priority | dispatch
    message: str


# --------------------------------------------------------------------------- state


def lock_decisions(session: Session) -> None:
    """Serialise scheduling decisions: the first statement of a decision's transaction is
    this UPDATE, which holds the row lock (PostgreSQL) or the database write lock (SQLite)
    until the decision commits."""
    session.execute(update(SchedulerLock).where(SchedulerLock.id == 1)
                    .values(decisions=SchedulerLock.decisions + 1)
                    .execution_options(synchronize_session=False))


def inventory_of(w: Worker) -> Inventory:
    return Inventory(id=w.id, gpus=len(w.gpus or []), executor=w.executor, slots=w.slots,
                     capabilities=dict(w.capabilities or {}))


def load_state(session: Session, settings: Settings, now: datetime,
               window: int = QUEUE_WINDOW) -> FleetState:
    stale_before = now - timedelta(seconds=settings.heartbeat_timeout_seconds)
    allocs: dict[str, list[GpuAllocation]] = {}
    for a in session.scalars(select(GpuAllocation)):
        allocs.setdefault(a.worker_id, []).append(a)
    workers: dict[str, WorkerView] = {}
    for w in session.scalars(select(Worker).where(Worker.state != WorkerState.lost)):
        held = allocs.get(w.id, [])
        taken = {a.gpu_index for a in held}
        indices = [int(g["index"]) for g in (w.gpus or [])]
        workers[w.id] = WorkerView(
            inv=inventory_of(w), state=w.state, fresh=w.heartbeat_at >= stale_before,
            gpu_indices=indices, free_gpus=[i for i in indices if i not in taken],
            free_cpu_slots=[k for k in range(w.slots) if cpu_slot_index(k) not in taken],
            running=len({a.job_id for a in held}))
    tenant_jobs = dict(session.execute(  # type: ignore[arg-type]
        select(Job.tenant_id, func.count(Job.id)).where(Job.status.in_(ACTIVE))
        .group_by(Job.tenant_id)).all())
    tenant_gpus = dict(session.execute(  # type: ignore[arg-type]
        select(Job.tenant_id, func.count(GpuAllocation.gpu_index))
        .join(GpuAllocation, GpuAllocation.job_id == Job.id)
        .where(GpuAllocation.gpu_index >= 0).group_by(Job.tenant_id)).all())
    rows = session.execute(
        select(Job.id, Job.tenant_id, Tenant.name, Job.priority, Job.created_at, Job.attempt,
               Job.pauses, Job.cancel_requested_at)
        .join(Tenant, Tenant.id == Job.tenant_id)
        .where(Job.status == JobStatus.queued)
        .order_by(Job.priority.desc(), Job.created_at, Job.id)
        .limit(window)).all()
    specs = _specs(session, [r.id for r in rows])
    queue = [Candidate(r.id, r.tenant_id, r.name, r.priority, r.created_at, r.attempt,
                       r.pauses, r.cancel_requested_at is not None, specs.get(r.id))
             for r in rows]
    return FleetState(workers, queue, tenant_jobs, tenant_gpus)


# A job's spec never changes once it is queued: parse each once per process, not at every
# decision (a decision reads up to QUEUE_WINDOW queued jobs).
_SPEC_CACHE: dict[str, JobSpec | None] = {}
_SPEC_CACHE_MAX = 20_000
_spec_lock = threading.Lock()


def _specs(session: Session, job_ids: list[str]) -> dict[str, JobSpec | None]:
    with _spec_lock:
        out = {j: _SPEC_CACHE[j] for j in job_ids if j in _SPEC_CACHE}
    missing = [j for j in job_ids if j not in out]
    if missing:
        parsed: dict[str, JobSpec | None] = {}
        for job_id, raw in session.execute(select(Job.id, Job.spec).where(Job.id.in_(missing))):
            try:
                parsed[job_id] = JobSpec.model_validate(raw)
            except ValidationError:
                parsed[job_id] = None  # the claim fails it with the reason
        with _spec_lock:
            if len(_SPEC_CACHE) + len(parsed) > _SPEC_CACHE_MAX:
                _SPEC_CACHE.clear()
            _SPEC_CACHE.update(parsed)
        out.update(parsed)
    return out


# --------------------------------------------------------------------------- rules


def runnable_on(c: Candidate, w: WorkerView, state: FleetState | None = None) -> bool:
    if c.spec is None:
        return False
    if state is None:
        return inventory_refusal(c.spec, w.inv) is None
    key = (c.id, w.inv.id)
    found = state.runnable.get(key)
    if found is None:
        found = state.runnable[key] = inventory_refusal(c.spec, w.inv) is None
    return found


def _need(c: Candidate, w: WorkerView) -> int:
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
    return _need(c, w) <= len(w.free_gpus)


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


def _eligible(queue: Iterable[Candidate]) -> Iterable[Candidate]:
    return (c for c in queue if not c.cancel_requested and c.spec is not None)


def reservation(state: FleetState, settings: Settings, now: datetime) -> tuple[str, str] | None:
    """(job, worker): the first job in queue order that has waited reserve_after_seconds and
    fits nowhere now, held on the worker with the most free GPUs that could ever run it."""
    old = now - timedelta(seconds=settings.reserve_after_seconds)
    for c in _eligible(state.queue):
        if c.created_at > old:
            continue
        hosts = [w for w in state.workers.values() if w.takes_jobs and runnable_on(c, w, state)]
        if not hosts or any(fits_now(c, w, state) for w in hosts):
            continue
        if tenant_block(c, state, settings, max(_need(c, w) for w in hosts)):
            continue
        best = min(hosts, key=lambda w: (-len(w.free_gpus), w.inv.id))
        return c.id, best.inv.id
    return None


def decide(state: FleetState, worker_id: str, settings: Settings,
           now: datetime) -> Placement | None:
    """The job worker ``worker_id`` starts now, on which GPUs, or None (see module doc)."""
    w = state.workers.get(worker_id)
    if w is None or not has_room(w):
        return None
    held: tuple[str, str] | None | bool = False  # computed at the first job that fits
    for c in _eligible(state.queue):
        if not fits_now(c, w, state):
            continue
        need = _need(c, w)
        if tenant_block(c, state, settings, need):
            continue
        if held is False:
            held = reservation(state, settings, now)
        if isinstance(held, tuple) and held[1] == worker_id and held[0] != c.id:
            return None  # this worker is held for the reserved job
        if w.inv.gpus == 0:
            return Placement(c.id, [], w.free_cpu_slots[0])
        return Placement(c.id, sorted(w.free_gpus)[:need], None)
    return None


def workers_with_work(state: FleetState, settings: Settings, now: datetime) -> list[str]:
    """The workers that would start a job if they looked now: where a doorbell is useful.
    A pool (SLURM) is rung when a queued job only it can run waits: it places the job
    itself."""
    found = [wid for wid in state.workers if decide(state, wid, settings, now) is not None]
    pools = [w for w in state.workers.values()
             if w.inv.executor != "local" and w.fresh and w.state == WorkerState.active]
    if pools:
        local = [w for w in state.workers.values() if w.takes_jobs]
        for_pools = [c for c in _eligible(state.queue)
                     if not any(runnable_on(c, w, state) for w in local)]
        found += [p.inv.id for p in pools
                  if any(runnable_on(c, p, state) for c in for_pools)]
    return found


def waiting(state: FleetState, job_id: str, settings: Settings, now: datetime) -> Waiting | None:
    """Where a queued job stands and what it waits for; None if it is not in the window."""
    eligible = list(_eligible(state.queue))
    for position, c in enumerate(eligible):
        if c.id == job_id:
            break
    else:
        return None
    live = [w for w in state.workers.values() if w.fresh and w.state == WorkerState.active]
    if not live:
        return Waiting(position, "worker", "no active worker is registered")
    assert c.spec is not None
    refusal = fleet_refusal(c.spec, [w.inv for w in live])
    if refusal is not None:
        return Waiting(position, "worker", f"no active worker can run it: {refusal}")
    hosts = [w for w in live if w.takes_jobs and runnable_on(c, w)]
    if not hosts:
        return Waiting(position, "worker", "only a pool with its own scheduler can run it")
    block = tenant_block(c, state, settings, min(_need(c, w) for w in hosts))
    if block is not None:
        return Waiting(position, "tenant_limit", block)
    held = reservation(state, settings, now)
    if held is not None and held[0] == c.id:
        return Waiting(position, "gpus",
                       f"GPUs: worker {held[1]} is reserved for it and starts nothing else "
                       "until enough of its GPUs are free")
    if not any(fits_now(c, w) for w in hosts):
        best = max(hosts, key=lambda w: len(w.free_gpus))
        if best.inv.gpus == 0:
            return Waiting(position, "gpus", "every CPU slot that could run it is busy")
        return Waiting(position, "gpus",
                       f"GPUs: needs {_need(c, best)}, the most free on a worker that can run "
                       f"it is {len(best.free_gpus)}")
    if position > 0:
        return Waiting(position, "priority",
                       f"{position} job(s) ahead of it in queue order (priority, then age)")
    return Waiting(position, "dispatch", "a worker with room is about to start it")
