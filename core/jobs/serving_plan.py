"""Deployments on the same fleet as training: which GPUs a requested deployment (an engine
server, core/serving/) is placed on, why one waits, and which idle deployments yield their
GPUs to a queued job. Pure, on the FleetState the job planner uses (core/jobs/scheduler.py).

The rules (docs/serving.md, "Placement"):

* Memory: a deployment needs its weights + KV cache (``DeploymentAsk.memory_mb``). On a
  GPU worker it holds whole GPUs, as many as that needs at ``HEADROOM`` of each (the engine
  runs tensor parallel over them); a GPU's memory unknown (0): one GPU.
* A GPU held by a deployment is a gpu_allocations row like a job's: no training job is
  given it, and the job planner sees it taken.
* Priority: a deployment ranks as a queued job of priority ``serving_priority``. Jobs of
  higher priority that the planner would start now keep their GPUs (the deployment gets
  what they leave, and not the GPUs a reservation of such a job needs); a job of that
  priority or lower waits for the deployment's GPUs.
* Who yields: a deployment never stops a running job, and one that is starting or in use
  keeps its GPUs. A ready deployment unused for ``serving_yield_idle_seconds`` (and not
  keep_warm) is stopped when a queued job of higher priority than ``serving_priority``
  fits nowhere now but would fit with its GPUs (``yields``); the next request for its model
  starts it again where there is room.
* Best fit: of the workers a deployment fits, the one it leaves the fewest GPUs free on; a
  supervisor takes a deployment planned for another worker only if it fits here as tightly.
* CPU workers (no GPUs) keep their serving budget: ``serving_slots`` engines and
  ``serving_memory_mb`` of weights + KV cache (``cpu_budget_refusal``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime

from core.infra.settings import Settings
from core.jobs.queue_model import FleetState, WorkerView
from core.jobs.scheduler import eligible, fits_now, need_of, plan, runnable_on

SERVING_CAPABILITY = "serving_engine"  # a worker's capabilities: it can run the engine
# Share of a GPU's memory a deployment's weights + KV cache may fill (the engine's own
# activations, CUDA context and fragmentation need the rest).
HEADROOM = 0.9


@dataclass(frozen=True)
class DeploymentAsk:
    """A requested deployment: what it needs, and since when."""

    id: str
    memory_mb: int  # weights + KV cache
    requested_at: datetime


@dataclass(frozen=True)
class ServingPlacement:
    deployment_id: str
    worker_id: str
    gpu_ids: list[int]


@dataclass(frozen=True)
class IdleDeployment:
    """A ready deployment unused for serving_yield_idle_seconds (not keep_warm)."""

    id: str
    worker_id: str
    gpus: int


def gpus_for(memory_mb: int, w: WorkerView) -> int | None:
    """GPUs of ``w`` a deployment of ``memory_mb`` needs; None: more than it has."""
    per_gpu = w.inv.gpu_memory_mb * HEADROOM
    need = 1 if per_gpu <= 0 else max(1, math.ceil(memory_mb / per_gpu))
    return need if need <= w.inv.gpus else None


def serves(w: WorkerView) -> bool:
    """A GPU worker open for placements that can run the engine."""
    return w.takes_jobs and w.inv.gpus > 0 and bool(w.inv.capabilities.get(SERVING_CAPABILITY))


def free_after_priority_jobs(state: FleetState, settings: Settings,
                             now: datetime) -> dict[str, WorkerView]:
    """Each worker as it is once the queued jobs of higher priority than serving_priority
    that start now hold their GPUs, with the GPUs a reservation of such a job needs there
    counted as taken."""
    ahead = [c for c in state.queue if c.priority > settings.serving_priority]
    if not ahead:
        return state.workers
    planned = plan(replace(state, queue=ahead), settings, now)
    left = dict(planned.left)
    held = planned.held
    if held is not None and held.worker_id in left:
        w = left[held.worker_id]
        keep = max(0, held.spare_gpus) if held.starts_by is not None else 0
        left[held.worker_id] = replace(w, free_gpus=sorted(w.free_gpus)[:keep])
    return left


def place(ask: DeploymentAsk, workers: dict[str, WorkerView]) -> ServingPlacement | str:
    """Where ``ask`` goes on ``workers`` (best fit), or why it waits."""
    hosts = [w for w in workers.values() if serves(w)]
    if not hosts:
        return "no active GPU worker with the inference engine is registered"
    needs = {w.inv.id: gpus_for(ask.memory_mb, w) for w in hosts}
    able = [w for w in hosts if needs[w.inv.id] is not None]
    if not able:
        largest = max(hosts, key=lambda w: (w.inv.gpus * w.inv.gpu_memory_mb, w.inv.id))
        return (f"needs {ask.memory_mb:,} MiB (weights + KV cache): more than the "
                f"{largest.inv.gpus} GPU(s) of {largest.inv.gpu_memory_mb:,} MiB of any "
                "worker hold")
    fit = [w for w in able if len(w.free_gpus) >= (needs[w.inv.id] or 0)]
    if not fit:
        best = max(able, key=lambda w: (len(w.free_gpus), w.inv.id))
        return (f"GPUs: needs {needs[best.inv.id]} ({ask.memory_mb:,} MiB of weights + KV "
                f"cache), the most free on a worker that can run it is {len(best.free_gpus)}"
                " (training jobs hold the others; a higher-priority queue keeps its share)")
    w = min(fit, key=lambda w: (len(w.free_gpus) - (needs[w.inv.id] or 0), w.inv.id))
    return ServingPlacement(ask.id, w.inv.id, sorted(w.free_gpus)[:needs[w.inv.id] or 0])


def decide(state: FleetState, asks: Sequence[DeploymentAsk], worker_id: str,
           settings: Settings, now: datetime) -> tuple[ServingPlacement | None, dict[str, str]]:
    """The deployment worker ``worker_id`` starts now, on which GPUs (or None), and why each
    requested one before it waits. In request order; each planned elsewhere holds its GPUs there
    for the ones behind it. The asking worker takes the first one planned for it, or planned
    elsewhere but fitting here as tightly (the worker asking is alive)."""
    workers = {wid: replace(w, free_gpus=list(w.free_gpus))
               for wid, w in free_after_priority_jobs(state, settings, now).items()}
    reasons: dict[str, str] = {}
    for ask in sorted(asks, key=lambda a: (a.requested_at, a.id)):
        where = place(ask, workers)
        if isinstance(where, str):
            reasons[ask.id] = where
            continue
        me = workers.get(worker_id)
        if where.worker_id == worker_id:
            return where, reasons
        if me is not None and serves(me):
            need = gpus_for(ask.memory_mb, me)
            planned = workers[where.worker_id]
            if need is not None and len(me.free_gpus) - need <= \
                    len(planned.free_gpus) - len(where.gpu_ids):
                return ServingPlacement(ask.id, worker_id, sorted(me.free_gpus)[:need]), reasons
        taken = workers[where.worker_id]
        taken.free_gpus = [g for g in taken.free_gpus if g not in where.gpu_ids]
    return None, reasons


def yields(state: FleetState, idle: Sequence[IdleDeployment], settings: Settings,
           now: datetime) -> list[str]:
    """The idle deployments to stop so that the first queued job of higher priority than
    serving_priority that fits nowhere now fits (its GPUs then free: the fewest
    deployments, on the worker that needs the fewest stopped); [] if none would help."""
    if not idle:
        return []
    planned = plan(state, settings, now)
    started = {p.job_id for _, p in planned.starts}
    for c in eligible(state.queue):
        if c.priority <= settings.serving_priority or c.id in started or c.spec is None:
            continue
        if any(fits_now(c, w, state) for w in planned.left.values()):
            continue
        best: list[str] | None = None
        for w in planned.left.values():
            if not w.takes_jobs or w.inv.gpus == 0 or not runnable_on(c, w, state) \
                    or w.free_slots <= 0:
                continue
            short = need_of(c, w) - len(w.free_gpus)
            chosen: list[str] = []
            for d in sorted((d for d in idle if d.worker_id == w.inv.id),
                            key=lambda d: (-d.gpus, d.id)):
                if short <= 0:
                    break
                chosen.append(d.id)
                short -= d.gpus
            if short <= 0 and (best is None or len(chosen) < len(best)):
                best = chosen
        if best:
            return best
    return []


def cpu_budget_refusal(memory_mb: int, held_mb: int, budget_mb: int | None) -> str | None:
    """Why a CPU worker whose deployments hold ``held_mb`` cannot take one more of
    ``memory_mb`` within its ``serving_memory_mb`` (None: no bound), or None."""
    if budget_mb is None or held_mb + memory_mb <= budget_mb:
        return None
    return (f"needs {memory_mb:,} MiB (weights + KV cache); the serving budget of a worker "
            f"is {budget_mb:,} MiB and its deployments hold {held_mb:,}")
