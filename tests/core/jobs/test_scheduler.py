"""core.jobs.scheduler's policy as pure functions over a FleetState built by hand (no database):
best fit, queue order, backfill, the reservation that keeps a large job from starving,
and tenant limits. tests/worker/run/test_scheduling.py runs the same rules through the
database and real claims."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from core.db.models import WorkerState
from core.infra.settings import Settings
from core.jobs import queue_wait, scheduler
from core.jobs.queue_model import Candidate, FleetState, Holding, WorkerView
from core.policy.fleet import Inventory
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
    waits = queue_wait.waiting(s, "big", settings(tmp_path), NOW)
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
    waits = queue_wait.waiting(s, "j1", cfg, NOW)
    assert waits is not None and waits.waiting_for == "tenant_limit"


# --------------------------------------------------------------------------- resume anywhere


def manifest(world: int = 2, per_device: int = 2, fmt: str = "dcp",
             strategy: str = "ddp") -> Any:
    from core.run.checkpoints import Manifest

    return Manifest(format=fmt, step=10, strategy=strategy, world_size=world,
                    per_device_train_batch_size=per_device, gradient_accumulation_steps=1,
                    trainable="adapter")


def resuming(jid: str, processes: int, resume_on: list[int], ckpt: Any = None,
             strategy: str = "ddp") -> Candidate:
    """A queued job continuing from checkpoint-10 (taken on ``processes`` processes, 2 per
    device, unless ``ckpt`` says otherwise) that allows ``resume_on``."""
    c = job(jid, processes)
    assert c.spec is not None
    dist = c.spec.distributed.model_copy(update={"strategy": strategy,
                                                 "resume_on": resume_on})
    c.spec = c.spec.model_copy(update={"distributed": dist})
    c.attempt = 1
    c.resume = scheduler.resumable(c.spec, "checkpoint-10",
                                   ckpt or manifest(processes, strategy=strategy))
    return c


def placed(s: FleetState, cfg: Settings) -> list[tuple[str, str, int | None, int]]:
    return [(wid, p.job_id, p.processes, len(p.gpu_ids))
            for wid, p in scheduler.plan(s, cfg, NOW).starts]


def test_counts_a_checkpoint_can_continue_on_keep_its_global_batch() -> None:
    c = resuming("j", 4, [3, 2, 1])  # global batch 2 x 4 = 8: not over 3
    assert c.resume is not None and c.resume.counts == (4, 2, 1)
    assert c.resume.global_batch == 8


def test_a_deepspeed_checkpoint_continues_on_other_counts_under_deepspeed() -> None:
    """Through DeepSpeed's universal checkpoint (core/train/deepspeed_checkpoint.py), with
    its global batch kept; never as a DCP checkpoint under another strategy."""
    ds = manifest(4, fmt="deepspeed", strategy="deepspeed")
    c = resuming("j", 4, [3, 2], ds, strategy="deepspeed")  # 8 does not split over 3
    assert c.resume is not None and c.resume.counts == (4, 2)
    assert resuming("j", 4, [2], ds, strategy="ddp").resume is None


def test_without_a_manifest_only_the_own_count_is_tried() -> None:
    c = job("j", 2)
    assert c.spec is not None
    c.spec = c.spec.model_copy(update={"distributed": c.spec.distributed.model_copy(
        update={"resume_on": [1]})})
    assert scheduler.resumable(c.spec, "checkpoint-10", None) is None
    assert scheduler.resumable(c.spec, None, manifest()) is None


def test_a_resuming_job_takes_the_one_free_gpu_on_one_process(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 2, 1)], [resuming("j", 2, [1])])
    assert placed(s, settings(tmp_path)) == [("w", "j", 1, 1)]


def test_without_resume_on_it_waits_for_its_own_slice(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 2, 1)], [job("j", 2)])
    assert placed(s, settings(tmp_path)) == []


def test_its_own_count_comes_first_when_it_fits(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 4, 4)], [resuming("j", 4, [2, 1])])
    assert placed(s, settings(tmp_path)) == [("w", "j", 4, 4)]


def test_the_largest_allowed_count_that_fits_is_chosen(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 8, 5)], [resuming("j", 8, [4, 2, 1])])
    assert placed(s, settings(tmp_path)) == [("w", "j", 4, 4)]


def test_a_count_the_global_batch_does_not_split_over_is_skipped(tmp_path: Path) -> None:
    # Global batch 1 per device x 4 processes = 4: over 3 the data position would be lost,
    # so with 3 GPUs free it continues on 2.
    s = state([gpu_worker("w", 4, 3)], [resuming("j", 4, [3, 2], manifest(4, per_device=1))])
    assert placed(s, settings(tmp_path)) == [("w", "j", 2, 2)]


def test_a_worker_asking_takes_another_workers_planned_resize(tmp_path: Path) -> None:
    """decide() may hand a start planned elsewhere to the worker asking: on the layout
    that was planned (1 process), not the job's own 2."""
    s = state([gpu_worker("a", 2, 1), gpu_worker("b", 2, 1)], [resuming("j", 2, [1])])
    cfg = settings(tmp_path)
    (wid, _), = scheduler.plan(s, cfg, NOW).starts
    other = "b" if wid == "a" else "a"
    got = scheduler.decide(s, other, cfg, NOW)
    assert got is not None and (got.job_id, got.processes, len(got.gpu_ids)) == ("j", 1, 1)


def test_the_resized_event_says_what_was_chosen_and_why(tmp_path: Path) -> None:
    c = resuming("j", 2, [1])
    s = state([gpu_worker("w", 2, 1)], [c])
    ((wid, p),) = scheduler.plan(s, settings(tmp_path), NOW).starts
    ev = scheduler.resized_event(c, p, wid)
    assert ev is not None
    assert ev["data"]["world_size"] == {"from": 2, "to": 1}
    assert ev["data"]["strategy"] == {"from": "ddp", "to": "none"}  # ddp needs two
    assert "checkpoint-10's global batch of 4 splits over 1" in ev["message"]
    assert scheduler.resized_event(c, replace(p, processes=2), wid) is None  # its own


def test_waiting_names_the_counts_it_could_continue_on(tmp_path: Path) -> None:
    s = state([gpu_worker("w", 4, 0)], [resuming("j", 4, [2])])
    w = queue_wait.waiting(s, "j", settings(tmp_path), NOW)
    assert w is not None and w.waiting_for == "gpus"
    assert "needs 4 (or 2 to continue from checkpoint-10)" in w.message


def test_a_job_grows_back_onto_a_larger_allowed_count(tmp_path: Path) -> None:
    # Paused on 2 (its checkpoint taken on 2), allowed 4: with 4 GPUs free it takes them.
    s = state([gpu_worker("w", 4, 4)], [resuming("j", 2, [4, 1])])
    assert placed(s, settings(tmp_path)) == [("w", "j", 4, 4)]


def test_a_reservation_is_for_the_jobs_own_count(tmp_path: Path) -> None:
    c = resuming("j", 4, [2])
    c.created_at = NOW - timedelta(hours=1)
    busy = [Holding("other", 4, NOW + timedelta(minutes=5))]
    s = state([gpu_worker("w", 4, 0, busy)], [c])
    planned = scheduler.plan(s, settings(tmp_path, reserve_after_seconds=60), NOW)
    assert planned.starts == [] and planned.held is not None
    assert (planned.held.job_id, planned.held.need) == ("j", 4)


def test_a_cpu_worker_runs_a_resuming_job_on_its_own_count(tmp_path: Path) -> None:
    # A CPU worker holds one slot for any count: nothing to fit, so nothing is resized there.
    cpu = WorkerView(inv=Inventory("cpu", gpus=0, slots=2), state=WorkerState.active,
                     fresh=True, gpu_indices=[], free_gpus=[], free_cpu_slots=[0, 1],
                     running=0, holding=[])
    s = state([cpu], [resuming("j", 2, [4, 1])])
    assert placed(s, settings(tmp_path)) == [("cpu", "j", 2, 0)]
