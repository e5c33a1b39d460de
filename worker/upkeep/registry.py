"""This worker in the fleet registry (the ``workers`` table): its inventory (GPUs, CPU cores,
what it can run, slots) written at start and heart-beaten while it runs. The API admits
against the registered inventories (core/policy/fleet.py), the scheduler places jobs on
them (core/jobs/scheduler.py), the reconciler marks silent workers lost.

``FTUNE_FAKE_GPUS`` replaces the real devices with a simulated list, for tests and
benchmarks with the fake trainer: everything downstream (allocation, CUDA_VISIBLE_DEVICES,
gpu_ids, ports) is the real code path.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from core.db.models import WORKER_GONE, Worker, WorkerState, utcnow
from core.db.session import execute_rowcount, session_scope
from core.infra.settings import Settings
from core.policy.slurm import SlurmPool, pool_from_settings
from core.serving.deployments import SERVING_CAPABILITY
from core.serving.engine import engine_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inventory:
    host: str
    gpus: list[dict[str, Any]]  # [{"index", "name", "memory_mb"}]
    cpu_cores: int
    capabilities: dict[str, Any]
    slots: int
    # "local": jobs run on this host's GPUs; "slurm": the worker hands them to its cluster.
    executor: str = "local"


def usable_cpus() -> list[int]:
    """The cores this worker may run on (its CPU affinity: a cpuset or taskset narrows it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))  # pragma: no cover - not Linux


def slot_cpus(cpus: list[int], slots: int, slot: int) -> list[int]:
    """The cores of CPU slot ``slot`` (0-based) when ``cpus`` are split evenly between
    ``slots``: contiguous runs, disjoint while there are at least as many cores as slots
    (with fewer, neighbouring slots share a core)."""
    start = slot * len(cpus) // slots
    end = max(start + 1, (slot + 1) * len(cpus) // slots)
    return cpus[start:end]


# What a host with a GPU driver has: NVIDIA's (a container from its runtime gets the device
# nodes too), WSL2's GPU passthrough (CUDA there goes through /dev/dxg, with no nvidia
# nodes) or ROCm's, which torch.cuda also speaks to.
GPU_DRIVER_PATHS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def _gpu_driver_present() -> bool:
    return any(os.path.exists(p) for p in GPU_DRIVER_PATHS)


@lru_cache(maxsize=1)
def _cuda_devices() -> tuple[tuple[str, int, bool], ...]:
    """(name, memory in MiB, bf16) of each visible CUDA device. Without a GPU driver there
    is none to find, and torch is not imported to say so (seconds of a worker's start)."""
    if not _gpu_driver_present():
        return ()
    try:
        import torch

        if not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append((str(p.name), int(p.total_memory) // (1 << 20), p.major >= 8))
        return tuple(out)
    except Exception:  # pragma: no cover - a broken CUDA install counts as none
        log.exception("could not list CUDA devices")
        return ()


def gpu_list(settings: Settings) -> list[dict[str, Any]]:
    """This worker's GPUs: the simulated ones if configured, else CUDA's (at most
    settings.worker_gpus of them)."""
    if settings.fake_gpus is not None:
        gpus = [{"index": i, "name": str(g.get("name", "fake-gpu")),
                 "memory_mb": int(g.get("memory_mb", 0)), "bf16": bool(g.get("bf16", True))}
                for i, g in enumerate(settings.fake_gpus)]
    elif settings.worker_gpus == 0:
        gpus = []  # a CPU worker by the operator's word: no need to import torch to ask
    else:
        gpus = [{"index": i, "name": name, "memory_mb": mem, "bf16": bf16}
                for i, (name, mem, bf16) in enumerate(_cuda_devices())]
    if settings.worker_gpus is not None:
        # The operator's count wins (as before the registry): fewer than CUDA sees, or GPUs
        # torch does not report here.
        gpus = gpus[:settings.worker_gpus]
        gpus += [{"index": i, "name": "unknown", "memory_mb": 0, "bf16": True}
                 for i in range(len(gpus), settings.worker_gpus)]
    return gpus


def inventory(settings: Settings) -> Inventory:
    pool = pool_from_settings(settings)
    if pool is not None:
        return pool_inventory(settings, pool)
    gpus = gpu_list(settings)
    caps = {
        "cuda": bool(gpus),
        "bf16": bool(gpus) and all(g["bf16"] for g in gpus),
        "flash_attn": bool(gpus) and importlib.util.find_spec("flash_attn") is not None,
        "cpu_fsdp2": not gpus and settings.cpu_fsdp2,
        "max_machines": 1,
        "simulated": settings.fake_gpus is not None,
        SERVING_CAPABILITY: settings.serving_slots > 0 and engine_problem(settings) is None,
    }
    slots = settings.worker_slots or max(1, len(gpus))
    listed = [{k: g[k] for k in ("index", "name", "memory_mb")} for g in gpus]
    return Inventory(socket.gethostname(), listed, len(usable_cpus()), caps, slots)


def pool_inventory(settings: Settings, pool: SlurmPool) -> Inventory:
    """A SLURM worker registers its partition: what one node of it holds, and how many
    nodes one job may take. It counts for admission; SLURM places the jobs."""
    gpus = [{"index": i, "name": f"{pool.partition} node GPU", "memory_mb": 0}
            for i in range(pool.gpus_per_node)]
    caps = {
        "cuda": bool(gpus),
        "bf16": bool(gpus),
        "flash_attn": False,  # what the nodes have installed is not known here
        "cpu_fsdp2": not gpus and settings.cpu_fsdp2,
        "max_machines": pool.max_nodes,
        "partition": pool.partition,
    }
    return Inventory(socket.gethostname(), gpus, pool.cpus_per_node, caps,
                     settings.worker_slots or 1, executor="slurm")


def register(session: Session, worker_id: str, inv: Inventory,
             now: datetime | None = None) -> None:
    """Insert or refresh this worker's row. A draining worker stays draining across a
    restart (an admin asked for it); a lost one is active again."""
    now = now or utcnow()
    row = session.get(Worker, worker_id, populate_existing=True)
    if row is None:
        session.add(Worker(id=worker_id, host=inv.host, executor=inv.executor, gpus=inv.gpus,
                           cpu_cores=inv.cpu_cores, capabilities=inv.capabilities,
                           slots=inv.slots, state=WorkerState.active, started_at=now,
                           heartbeat_at=now))
        session.flush()
        return
    row.host, row.gpus, row.cpu_cores = inv.host, inv.gpus, inv.cpu_cores
    row.executor = inv.executor
    row.capabilities, row.slots, row.heartbeat_at = inv.capabilities, inv.slots, now
    if row.state in WORKER_GONE:
        row.state = WorkerState.active
    session.flush()


def mark_stopped(settings: Settings, worker_id: str) -> None:
    """A clean shutdown: the dashboard and GET /v1/workers say "stopped", not "lost"."""
    with session_scope() as s:
        s.execute(update(Worker).where(Worker.id == worker_id)
                  .values(state=WorkerState.stopped)
                  .execution_options(synchronize_session=False))


def heartbeat(session: Session, worker_id: str, now: datetime | None = None) -> bool:
    """False if the row is gone (then the caller registers again)."""
    n = execute_rowcount(session, update(Worker).where(Worker.id == worker_id)
                         .values(heartbeat_at=now or utcnow())
                         .execution_options(synchronize_session=False))
    if n == 1:
        # A worker marked lost while it was merely slow is back.
        session.execute(update(Worker).where(Worker.id == worker_id,
                                             Worker.state == WorkerState.lost)
                        .values(state=WorkerState.active)
                        .execution_options(synchronize_session=False))
    return n == 1


def ensure_registered(settings: Settings, worker_id: str) -> None:
    with session_scope() as s:
        ensure_registered_in(s, settings, worker_id)


def ensure_registered_in(session: Session, settings: Settings, worker_id: str) -> None:
    """Heart-beat this worker's row, or register it if the row is gone."""
    if not heartbeat(session, worker_id):
        register(session, worker_id, inventory(settings))


def start_heartbeat_thread(settings: Settings, worker_id: str,
                           stop: threading.Event) -> threading.Thread:
    """Register now, then heart-beat every heartbeat_seconds until ``stop`` is set."""
    ensure_registered(settings, worker_id)

    def loop() -> None:
        while not stop.wait(settings.heartbeat_seconds):
            try:
                ensure_registered(settings, worker_id)
            except SQLAlchemyError:
                log.warning("worker heartbeat failed", exc_info=True)

    t = threading.Thread(target=loop, name="ftune-worker-heartbeat", daemon=True)
    t.start()
    return t
