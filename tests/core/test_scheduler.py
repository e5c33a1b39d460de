"""core.scheduler's policy as pure functions over a FleetState built by hand (no database):
best fit, queue order, backfill, the reservation that keeps a large job from starving,
and tenant limits. tests/worker/run/test_scheduling.py runs the same rules through the
database and real claims."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from core import scheduler
from core.db.models import WorkerState
from core.policy.fleet import Inventory
from core.scheduler import Candidate, FleetState, Holding, WorkerView
from core.settings import Settings
from core.spec import parse_job_spec

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def gpu_worker(wid: str, gpus: int, free: int, holding: list[Holding] | None = None,
               ) -> WorkerView:
    return WorkerView(inv=Inventory(wid, gpus=gpus, slots=8), state=WorkerState.active,
                      fresh=True, gpu_indices=list(range(gpus)),
                      free_gpus=list(range(gpus - free, gpus)), free_cpu_slots=[],
                      running=len(holding or []), holding=holding or [])


def job(jid: str, processes: int = 1, *, priority: int = 0, age_s: float = 0,
        tenant: str = "t1", **training: Any) -> Candidate:
    dist = ({"strategy": "ddp", "num_processes": processes} if processes > 1
            else {"strategy": "none"})
    spec = parse_job_spec({"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
                           "distributed": dist, "training": training})
    return Candidate(jid, tenant, tenant, priority, NOW - timedelta(seconds=age_s), 0, 0,
                     False, spec)


def state(workers: list[WorkerView], queue: list[Candidate], **kw: Any) -> FleetState:
    return FleetState({w.inv.id: w for w in workers}, queue, **kw)


def settings(tmp_path: Path, **over: Any) -> Settings:
    return Settings(data_dir=tmp_path, **over)


def starts(s: FleetState, cfg: Settings) -> list[tuple[str, str]]:
    return [(wid, p.job_id) for wid, p in scheduler.plan(s, cfg, NOW).starts]


def test_a_job_goes_where_it_fits_most_tightly(tmp_path: Path) -> None:
    s = state([gpu_worker("big", 8, 8), gpu_worker("small", 2, 1)], [job("j1")])
    assert starts(s, settings(tmp_path)) == [("small", "j1")]


def test_higher_priority_starts_first(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 1, 1)], [job("low", age_s=60), job("high", priority=5)])
    s.queue.sort(key=lambda c: (-c.priority, c.created_at))  # load_state's queue order
    assert starts(s, settings(tmp_path)) == [("w", "high")]


def test_a_small_job_backfills_past_one_that_does_not_fit(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 4, 2)], [job("big", 4), job("small", 1)])
    assert starts(s, settings(tmp_path)) == [("w", "small")]
    waits = scheduler.waiting(s, "big", settings(tmp_path), NOW)
    assert waits is not None and waits.waiting_for == "gpus"


def test_a_starving_job_reserves_a_worker_and_nothing_undated_starts_there(
    tmp_path: Path,
) -> None:
    # A running job without a time limit holds 2 of 4 GPUs: the old 4-GPU job reserves the
    # worker, and the 1-GPU job behind it (no time limit either) may not take a GPU it needs.
    running = [Holding("r", 2, free_by=None)]
    s = state([gpu_worker("w", 4, 2, running)], [job("big", 4, age_s=3600), job("small")])
    cfg = settings(tmp_path, reserve_after_seconds=60)
    planned = scheduler.plan(s, cfg, NOW)
    assert planned.held is not None and planned.held.job_id == "big"
    assert planned.starts == []
    assert scheduler.decide(s, "w", cfg, NOW, planned) is None


def test_a_tenant_at_its_running_limit_waits(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 2, 2)], [job("j1", tenant="acme"), job("j2", tenant="other")],
              tenant_jobs={"acme": 1})
    cfg = settings(tmp_path, tenant_limits={"acme": {"max_running_jobs": 1}})
    assert starts(s, cfg) == [("w", "j2")]
    waits = scheduler.waiting(s, "j1", cfg, NOW)
    assert waits is not None and waits.waiting_for == "tenant_limit"
