"""core.jobs.serving_plan as pure functions over a FleetState built by hand: a deployment's
GPUs from its memory, best fit, the GPUs higher-priority jobs keep, why one waits, which idle
deployments yield to a queued job, and the CPU budget. tests/worker/serve/test_claim.py
places one through the database and a worker's claim."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from core.db.models import WorkerState
from core.infra.settings import Settings
from core.jobs import serving_plan
from core.jobs.queue_model import Candidate, FleetState, WorkerView
from core.jobs.serving_plan import SERVING_CAPABILITY, DeploymentAsk, IdleDeployment
from core.policy.fleet import Inventory
from core.spec import parse_job_spec

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
GPU_MB = 10_000


def worker(wid: str, gpus: int, free: int, *, engine: bool = True) -> WorkerView:
    inv = Inventory(wid, gpus=gpus, slots=8, gpu_memory_mb=GPU_MB,
                    capabilities={SERVING_CAPABILITY: engine})
    return WorkerView(inv=inv, state=WorkerState.active, fresh=True,
                      gpu_indices=list(range(gpus)), free_gpus=list(range(gpus - free, gpus)),
                      free_cpu_slots=[], running=0)


def job(jid: str, processes: int = 1, *, priority: int = 0) -> Candidate:
    dist = ({"strategy": "ddp", "num_processes": processes} if processes > 1
            else {"strategy": "none"})
    spec = parse_job_spec({"model": {"name_or_path": "org/m"}, "dataset": {"path": "/d"},
                           "distributed": dist})
    return Candidate(jid, "t", "t", priority, NOW, 0, 0, False, spec)


def ask(did: str, memory_mb: int = 5_000, age_s: float = 0) -> DeploymentAsk:
    return DeploymentAsk(did, memory_mb, NOW - timedelta(seconds=age_s))


def fleet(workers: list[WorkerView], queue: list[Candidate] | None = None) -> FleetState:
    return FleetState({w.inv.id: w for w in workers}, queue or [])


def settings(tmp_path: Path, **over: Any) -> Settings:
    return Settings(data_dir=tmp_path, **over)


def test_a_deployment_holds_as_many_gpus_as_its_weights_and_kv_cache_need() -> None:
    w = worker("w", 4, 4)
    assert serving_plan.gpus_for(5_000, w) == 1
    assert serving_plan.gpus_for(25_000, w) == 3  # 9,000 MiB of each GPU at 0.9
    assert serving_plan.gpus_for(40_000, w) is None


def test_it_goes_where_it_fits_most_tightly(tmp_path: Path) -> None:
    state = fleet([worker("big", 8, 8), worker("small", 2, 1)])
    placed, _ = serving_plan.decide(state, [ask("d")], "big", settings(tmp_path), NOW)
    assert placed is None  # planned for "small": "big" leaves it to that worker
    placed, _ = serving_plan.decide(state, [ask("d")], "small", settings(tmp_path), NOW)
    assert placed is not None and (placed.worker_id, placed.gpu_ids) == ("small", [1])


def test_a_worker_without_the_engine_or_gpus_is_not_a_host(tmp_path: Path) -> None:
    state = fleet([worker("plain", 2, 2, engine=False)])
    placed, why = serving_plan.decide(state, [ask("d")], "plain", settings(tmp_path), NOW)
    assert placed is None and "no active GPU worker with the inference engine" in why["d"]


def test_one_too_large_for_any_worker_says_so(tmp_path: Path) -> None:
    state = fleet([worker("w", 2, 2)])
    _, why = serving_plan.decide(state, [ask("d", 50_000)], "w", settings(tmp_path), NOW)
    assert why["d"].startswith("needs 50,000 MiB (weights + KV cache): more than the 2 GPU(s)")


def test_a_higher_priority_job_keeps_the_gpus_it_would_start_on(tmp_path: Path) -> None:
    state = fleet([worker("w", 1, 1)], [job("urgent", priority=5)])
    placed, why = serving_plan.decide(state, [ask("d")], "w", settings(tmp_path), NOW)
    assert placed is None and why["d"].startswith("GPUs: needs 1 (5,000 MiB")
    assert "the most free on a worker that can run it is 0" in why["d"]


def test_a_job_of_serving_priority_or_lower_waits_for_the_deployment(tmp_path: Path) -> None:
    state = fleet([worker("w", 1, 1)], [job("batch", priority=0)])
    placed, _ = serving_plan.decide(state, [ask("d")], "w", settings(tmp_path), NOW)
    assert placed is not None and placed.gpu_ids == [0]


def test_deployments_are_placed_in_request_order(tmp_path: Path) -> None:
    state = fleet([worker("w", 1, 1)])
    placed, _ = serving_plan.decide(state, [ask("new"), ask("old", age_s=30)], "w",
                                    settings(tmp_path), NOW)
    assert placed is not None and placed.deployment_id == "old"


def test_an_idle_deployment_yields_to_a_higher_priority_job_that_fits_nowhere(
        tmp_path: Path) -> None:
    state = fleet([worker("w", 2, 0)], [job("urgent", 2, priority=5)])
    idle = [IdleDeployment("a", "w", 1), IdleDeployment("b", "w", 1)]
    assert sorted(serving_plan.yields(state, idle, settings(tmp_path), NOW)) == ["a", "b"]
    assert serving_plan.yields(state, idle[:1], settings(tmp_path), NOW) == []  # not enough


def test_no_deployment_yields_to_a_job_of_serving_priority(tmp_path: Path) -> None:
    state = fleet([worker("w", 1, 0)], [job("batch", priority=0)])
    idle = [IdleDeployment("a", "w", 1)]
    assert serving_plan.yields(state, idle, settings(tmp_path), NOW) == []
    raised = settings(tmp_path, serving_priority=-1)
    assert serving_plan.yields(state, idle, raised, NOW) == ["a"]


def test_a_cpu_worker_keeps_its_serving_budget() -> None:
    assert serving_plan.cpu_budget_refusal(2_000, 1_000, None) is None
    assert serving_plan.cpu_budget_refusal(2_000, 1_000, 3_000) is None
    why = serving_plan.cpu_budget_refusal(2_000, 1_500, 3_000)
    assert why is not None and "budget of a worker is 3,000 MiB" in why
