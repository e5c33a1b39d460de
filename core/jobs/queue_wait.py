"""Why a queued job waits, and where it stands (``waiting``): what GET /v1/jobs/{id} shows as
``queue``. Read from the same plan the scheduler decides by (core/jobs/scheduler.py)."""

from __future__ import annotations

from datetime import datetime

from core.db.models import WorkerState
from core.infra.settings import Settings
from core.jobs.queue_model import FleetState, Waiting, hosts_count, variants
from core.jobs.scheduler import (
    Plan,
    eligible,
    fits_now,
    need_of,
    plan,
    runnable_on,
    tenant_block,
)
from core.policy.fleet import fleet_refusal


def waiting(state: FleetState, job_id: str, settings: Settings, now: datetime,
            planned: Plan | None = None) -> Waiting | None:
    """Where a queued job stands and what it waits for; None if it is not in the window.
    ``planned``: as for ``decide`` (a caller asking for many jobs of one state plans once)."""
    for position, c in enumerate(list(eligible(state.queue))):
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
    hosts = [w for w in live if w.takes_jobs and hosts_count(c, w) and runnable_on(c, w)]
    if not hosts:
        return Waiting(position, "worker",
                       "a worker of a pool with its own scheduler (SLURM) will submit it there")
    block = tenant_block(c, state, settings, min(need_of(c, w) for w in hosts))
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
    if not any(fits_now(v, w) for v in tried for w in live if hosts_count(v, w)):
        best = max(hosts, key=lambda w: len(w.free_gpus))
        if best.inv.gpus == 0:
            return Waiting(position, "gpus", "every CPU slot that could run it is busy")
        others = [str(need_of(v, best)) for v in tried if v is not c]
        alt = (f" (or {', '.join(others)} to continue from {c.resume.checkpoint})"
               if others and c.resume is not None else "")
        return Waiting(position, "gpus",
                       f"GPUs: needs {need_of(c, best)}{alt}, the most free on a worker that "
                       f"can run it is {len(best.free_gpus)}")
    if position > 0:
        return Waiting(position, "priority",
                       f"{position} job(s) ahead of it in queue order (priority, then age)")
    return Waiting(position, "dispatch", "a worker with room is about to start it")
