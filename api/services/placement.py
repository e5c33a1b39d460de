"""Admission's choice of strategy and process count for a job that does not name them (an
OpenAI-style job, or a JobSpec without ``distributed``): the pure rule in
core/policy/placement.py, fed with the registered fleet's GPUs and the model's memory
estimate (core/model/estimate.py, on the meta device: no weights read)."""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import WORKER_GONE, Worker, utcnow
from core.infra.settings import Settings
from core.policy.placement import GpuWorker, MemoryNeed, Placement, choose_placement
from core.spec import JobSpec

log = logging.getLogger("ftune.api")


def gpu_fleet(session: Session, settings: Settings) -> list[GpuWorker]:
    """Heart-beating workers that have GPUs, each with its smallest GPU's memory."""
    fresh = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = session.scalars(select(Worker).where(Worker.state.not_in(WORKER_GONE),
                                                Worker.heartbeat_at >= fresh))
    return [GpuWorker(gpus=len(w.gpus), memory_mb=min(float(g.get("memory_mb") or 0)
                                                      for g in w.gpus))
            for w in rows if w.gpus]


def memory_need(spec: JobSpec, settings: Settings) -> MemoryNeed | None:
    """One unsharded process's memory; None when the model cannot be read here (a hub
    model: the API downloads nothing) or not built on the meta device."""
    from core.model.estimate import estimate
    from core.policy import Refused, model_kind, model_location

    if model_kind(spec.model.name_or_path) != "path" or spec.model.trust_remote_code:
        return None  # no download, and no repository code runs in the API
    single = spec.model_copy(update={"distributed": spec.distributed.model_copy(
        update={"strategy": "none", "num_processes": 1})})
    try:
        path = model_location(spec.model.name_or_path, settings, need_config=True)
        e = estimate(single, str(path))
    except (Refused, OSError, ValueError):
        log.info("no memory estimate for %s; placing it on one process",
                 spec.model.name_or_path)
        return None
    return MemoryNeed(e.gpu_weights_mb, e.gpu_training_state_mb, e.gpu_activations_mb)


def place(session: Session, settings: Settings, spec: JobSpec,
          catalog_gpus: int | None = None) -> Placement:
    fleet = gpu_fleet(session, settings)
    need = memory_need(spec, settings) if fleet and catalog_gpus is None else None
    return choose_placement(need, fleet, catalog_gpus)


def with_placement(session: Session, settings: Settings,
                   spec: JobSpec) -> tuple[JobSpec, Placement]:
    """The spec with ``distributed`` chosen (strategy and process count; FSDP's other
    settings keep their defaults), and the choice. One process is the spec's default: then
    the spec is left as it was."""
    p = place(session, settings, spec)
    if (p.strategy, p.num_processes) == ("none", 1):
        return spec, p
    dist = spec.distributed.model_copy(update={"strategy": p.strategy,
                                               "num_processes": p.num_processes})
    return spec.model_copy(update={"distributed": dist}), p
