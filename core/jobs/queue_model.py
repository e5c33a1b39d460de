"""The queue's data, as the scheduler plans on it (core/jobs/scheduler.py): the workers with
what they hold, the queued jobs (candidates) and the layouts each may start with, and what
a plan returns (placements, a reservation, why a job waits). Pure: no database
(core/jobs/queue_load.py loads a FleetState)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from core.db.models import WORKER_GONE, WorkerState
from core.infra.settings import Settings
from core.policy.fleet import Inventory
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


def hosts_count(c: Candidate, w: WorkerView) -> bool:
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
