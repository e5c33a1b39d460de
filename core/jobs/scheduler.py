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
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from core.db.models import WORKER_GONE, WorkerState
from core.infra.settings import Settings
from core.policy.fleet import Inventory, fleet_refusal, gpus_needed, inventory_refusal
from core.policy.limits import run_deadline, time_limit
from core.run.checkpoints import Manifest, resume_refusal
from core.spec import JobSpec

QUEUE_WINDOW = 200  # queued jobs a decision looks at, in queue order (how far it backfills)


def cpu_slot_index(slot: int) -> int:
    """CPU slots are allocated like GPUs, at negative indices (-1, -2, ...), under the same
    primary key: a CPU slot is never handed to two jobs either."""
    return -(slot + 1)


@dataclass(frozen=True)
class Holding:
    """A job running on a worker: the GPUs it holds (and its slot), and the latest moment
    it gives them back (its deadline plus the kill grace; None: it has no time limit)."""

    job_id: str
    gpus: int
    free_by: datetime | None


@dataclass
class WorkerView:
    inv: Inventory
    state: str
    fresh: bool
    gpu_indices: list[int]
    free_gpus: list[int]
    free_cpu_slots: list[int]
    running: int
    holding: list[Holding] = field(default_factory=list)
    # Deployments placed here (core/jobs/serving_plan.py): id -> the GPUs each holds. They
    # take GPUs, never a training slot.
    serving: dict[str, int] = field(default_factory=dict)

    @property
    def takes_jobs(self) -> bool:
        """Open for placements here. A pool with an executor of its own (SLURM) counts for
        admission but places its jobs itself."""
        return self.state == WorkerState.active and self.fresh and self.inv.executor == "local"

    @property
    def free_slots(self) -> int:
        return self.inv.slots - self.running


@dataclass(frozen=True)
class Resumable:
    """A queued job that continues from a checkpoint and may do so on other process counts
    (``distributed.resume_on``)."""

    checkpoint: str  # its directory name, e.g. checkpoint-40
    global_batch: int  # what the checkpoint was trained with, kept on every count
    counts: tuple[int, ...]  # process counts it may start on (its own among them), largest first


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
    resume: Resumable | None = None  # None: it starts on its own process count only
    resized_from: int | None = None  # its own count, when this is it on another (at_count)


@dataclass
class FleetState:
    workers: dict[str, WorkerView]
    queue: list[Candidate]
    tenant_jobs: dict[str, int] = field(default_factory=dict)
    tenant_gpus: dict[str, int] = field(default_factory=dict)
    # (job, processes, worker) -> whether the worker's inventory can run the job on that
    # many processes: asked for every candidate on every worker, and the answer does not
    # change within a decision.
    runnable: dict[tuple[str, int, str], bool] = field(default_factory=dict)

    def inventories(self) -> list[Inventory]:
        return [w.inv for w in self.workers.values() if w.state not in WORKER_GONE]


@dataclass(frozen=True)
class Placement:
    job_id: str
    gpu_ids: list[int]  # physical indices on the worker; [] on a CPU worker
    cpu_slot: int | None  # the CPU slot taken (CPU workers)
    processes: int | None = None  # the run's process count; None: as its spec says

    @property
    def allocation_indices(self) -> list[int]:
        if self.cpu_slot is not None:
            return [cpu_slot_index(self.cpu_slot)]
        return list(self.gpu_ids)


@dataclass(frozen=True)
class Reservation:
    """Worker ``worker_id`` is held for job ``job_id`` (see the module doc)."""

    job_id: str
    worker_id: str
    need: int  # GPUs it needs there
    # When the worker has room for the job at the latest (from the deadlines of the jobs
    # running there); None: not known, a job without a time limit is in the way.
    starts_by: datetime | None
    spare_gpus: int  # free GPUs at starts_by beyond what the job needs
    spare_slots: int  # free slots at starts_by beyond the job's own


@dataclass(frozen=True)
class Waiting:
    position: int  # jobs ahead of it in queue order
    waiting_for: str  # worker | gpus | tenant_limit | priority | dispatch
    message: str


def free_by(spec: JobSpec | None, started_at: datetime | None, paused_seconds: float,
             settings: Settings) -> datetime | None:
    """The latest moment a running job gives its GPUs back: its deadline plus the grace the
    worker gives a stopping trainer before it kills it. None: no time limit."""
    limit = time_limit(spec, settings.default_timeout_seconds) if spec is not None else None
    if started_at is None:
        return None
    deadline = run_deadline(started_at.timestamp(), paused_seconds, limit)
    if deadline is None:
        return None
    return datetime.fromtimestamp(deadline + settings.cancel_grace_seconds, UTC)


def resumable(spec: JobSpec, checkpoint: str | None,
              manifest: Manifest | None) -> Resumable | None:
    """How a job that continues from ``checkpoint`` (taken as ``manifest`` says) may start:
    on its own process count, or on one of ``distributed.resume_on`` over which the
    checkpoint resumes (``resume_refusal``: its global batch splits; DeepSpeed's through
    its universal checkpoint), largest first. None: only on its own count (no other count listed, no
    checkpoint, or one without a manifest, whose batch layout is not known)."""
    dist = spec.distributed
    if not dist.resume_on or checkpoint is None or manifest is None:
        return None
    others = {n for n in dist.resume_on if n != dist.num_processes
              and resume_refusal(manifest, dist.on(n).strategy, n) is None}
    if not others:
        return None
    return Resumable(checkpoint, manifest.global_batch,
                     tuple(sorted({dist.num_processes, *others}, reverse=True)))


def at_count(c: Candidate, processes: int | None) -> Candidate:
    """``c`` as it would run on ``processes`` processes (None or its own: ``c`` itself)."""
    if c.spec is None or processes is None or processes == c.spec.distributed.num_processes:
        return c
    return replace(c, spec=c.spec.model_copy(
        update={"distributed": c.spec.distributed.on(processes)}),
        resized_from=c.spec.distributed.num_processes)


def variants(c: Candidate) -> list[Candidate]:
    """The layouts ``c`` may start with now, in the order the scheduler tries them: its own
    process count, or those of ``c.resume``, largest first."""
    if c.resume is None:
        return [c]
    return [at_count(c, n) for n in c.resume.counts]


def _hosts_count(c: Candidate, w: WorkerView) -> bool:
    """Whether ``w`` may run ``c`` on the count it has now: another count than the job's own
    (``at_count``) only on a GPU worker, where the count is what has to fit; a CPU worker
    runs a job in one slot whatever its count."""
    return w.inv.gpus > 0 or c.resized_from is None


def resized_event(c: Candidate, p: Placement, worker_id: str) -> dict[str, Any] | None:
    """What a claim says when the scheduler started ``c`` on another process count than its
    own (a "resized" event's message and data), or None."""
    if c.spec is None or c.resume is None or p.processes is None:
        return None
    dist = c.spec.distributed
    if p.processes == dist.num_processes:
        return None
    to = dist.on(p.processes)
    allowed = ", ".join(str(n) for n in c.resume.counts)
    message = (f"continues on {p.processes} process(es) ({to.strategy}), not its own "
               f"{dist.num_processes}: the most of its allowed counts ({allowed}; "
               f"distributed.resume_on) that fits now, on worker {worker_id}; "
               f"{c.resume.checkpoint}'s global batch of {c.resume.global_batch} splits over "
               f"{p.processes}")
    return {"message": message, "data": {
        "world_size": {"from": dist.num_processes, "to": p.processes},
        "strategy": {"from": dist.strategy, "to": to.strategy},
        "checkpoint": c.resume.checkpoint, "global_batch": c.resume.global_batch,
        "gpu_ids": list(p.gpu_ids), "worker_id": worker_id, "by": "scheduler",
        "allowed": list(c.resume.counts)}}


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
    for job in list(_eligible(work.queue)):
        # Its own process count, or (resuming from a checkpoint) the counts it allows,
        # largest first: the first one that may start now starts.
        tried = variants(job)
        runs: dict[int, tuple[Candidate, list[WorkerView]]] = {}  # count -> workers for it
        placed = False
        for c in tried:
            hosts = [w for w in work.workers.values()
                     if w.takes_jobs and _hosts_count(c, w) and runnable_on(c, w, state)]
            if not hosts:
                continue
            assert c.spec is not None
            runs[c.spec.distributed.num_processes] = (c, hosts)
            fit = [w for w in hosts if fits_now(c, w, state)
                   and not tenant_block(c, work, settings, _need(c, w))
                   and (held is None or w.inv.id != held.worker_id
                        or backfills(c, _need(c, w), held, settings, now))]
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
                            if _hosts_count(v, w))
                and not tenant_block(c, work, settings, max(_need(c, w) for w in hosts))):
            rooms = {w.inv.id: room_by(w, _need(c, w), now) for w in hosts}
            best = min(hosts, key=lambda w: (rooms[w.inv.id][0] is None,
                                             rooms[w.inv.id][0] or now,
                                             -len(w.free_gpus), w.inv.id))
            held = Reservation(c.id, best.inv.id, _need(c, best), *rooms[best.inv.id])
    return Plan(starts, held, work.workers)


def _room(w: WorkerView, need: int, now: datetime) -> dict[str, Any]:
    starts_by, spare_gpus, spare_slots = room_by(w, need, now)
    return {"starts_by": starts_by, "spare_gpus": spare_gpus, "spare_slots": spare_slots}


def _spare(c: Candidate, w: WorkerView) -> int:
    """What would stay free on ``w`` if ``c`` started there (GPUs, or CPU slots)."""
    if w.inv.gpus == 0:
        return len(w.free_cpu_slots) - 1
    return len(w.free_gpus) - _need(c, w)


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
        if not _hosts_count(c, left) or not fits_now(c, left, state):
            continue
        if held is not None and held.worker_id == worker_id and \
                not backfills(c, _need(c, left), held, settings, now):
            continue
        return _placement(c, left)
    return None


def _placement(c: Candidate, w: WorkerView) -> Placement:
    assert c.spec is not None
    processes = c.spec.distributed.num_processes
    if w.inv.gpus == 0:
        return Placement(c.id, [], w.free_cpu_slots[0], processes)
    return Placement(c.id, sorted(w.free_gpus)[:_need(c, w)], None, processes)


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
        for_pools = [c for c in _eligible(state.queue)
                     if not any(runnable_on(v, w, state) for v in variants(c) for w in local)]
        found += [p.inv.id for p in pools
                  if any(runnable_on(c, p, state) for c in for_pools)]
    return found


def waiting(state: FleetState, job_id: str, settings: Settings, now: datetime,
            planned: Plan | None = None) -> Waiting | None:
    """Where a queued job stands and what it waits for; None if it is not in the window.
    ``planned``: as for ``decide`` (a caller asking for many jobs of one state plans once)."""
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
    tried = variants(c)
    able = [v for v in tried if v.spec and fleet_refusal(v.spec, [w.inv for w in live]) is None]
    if not able:
        refusal = fleet_refusal(c.spec, [w.inv for w in live])
        return Waiting(position, "worker", f"no active worker can run it: {refusal}")
    c = c if any(v is c for v in able) else able[0]  # its own count where a worker can run it
    hosts = [w for w in live if w.takes_jobs and _hosts_count(c, w) and runnable_on(c, w)]
    if not hosts:
        return Waiting(position, "worker",
                       "a worker of a pool with its own scheduler (SLURM) will submit it there")
    block = tenant_block(c, state, settings, min(_need(c, w) for w in hosts))
    if block is not None:
        return Waiting(position, "tenant_limit", block)
    held = (planned or plan(state, settings, now)).held
    if held is not None and held.job_id == c.id:
        if held.starts_by is None:
            return Waiting(position, "gpus",
                           f"GPUs: worker {held.worker_id} is reserved for it and starts "
                           "nothing else until enough of its GPUs are free")
        return Waiting(position, "gpus",
                       f"GPUs: worker {held.worker_id} is reserved for it; it starts by "
                       f"{held.starts_by.isoformat(timespec='seconds')} at the latest (the "
                       "time limits of the jobs running there)")
    if not any(fits_now(v, w) for v in tried for w in live if _hosts_count(v, w)):
        best = max(hosts, key=lambda w: len(w.free_gpus))
        if best.inv.gpus == 0:
            return Waiting(position, "gpus", "every CPU slot that could run it is busy")
        others = [str(_need(v, best)) for v in tried if v is not c]
        alt = (f" (or {', '.join(others)} to continue from {c.resume.checkpoint})"
               if others and c.resume is not None else "")
        return Waiting(position, "gpus",
                       f"GPUs: needs {_need(c, best)}{alt}, the most free on a worker that "
                       f"can run it is {len(best.free_gpus)}")
    if position > 0:
        return Waiting(position, "priority",
                       f"{position} job(s) ahead of it in queue order (priority, then age)")
    return Waiting(position, "dispatch", "a worker with room is about to start it")
