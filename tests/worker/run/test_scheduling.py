"""The scheduler's rules through the real claim (worker/run/claim.py ``claim_next``) on a
PostgreSQL database of this module's own: priority then FIFO, disjoint GPUs, tenant limits,
reservation against starvation and backfill around it, drain, doorbells, concurrent claims,
and every way out of running freeing exactly that job's GPUs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import delete, select, update

from core.db.models import (
    GpuAllocation,
    Job,
    JobStatus,
    SchedulerLock,
    Tenant,
    Worker,
    WorkerState,
    utcnow,
)
from core.db.session import session_scope
from core.infra.settings import Settings
from core.jobs import queue_load, queue_wait, scheduler
from core.jobs import state as jobstate
from tests.utils.worker import WorkerEnv
from worker.run.claim import Claim, claim_next, holder
from worker.upkeep.registry import Inventory, register


@pytest.fixture(scope="module")
def own_pg() -> Iterator[str]:
    from testkit.pg import migrated_database

    with migrated_database() as url:
        yield url


@pytest.fixture
def env(tmp_path: Path, own_pg: str,
        configure: Callable[..., WorkerEnv]) -> Iterator[Callable[..., Settings]]:
    def _with(**overrides: str) -> Settings:
        return configure(tmp_path, own_pg, **overrides).settings

    _with()
    yield _with
    with session_scope() as s:
        for table in (GpuAllocation, Job, Tenant, Worker):
            s.execute(delete(table))


def add_worker(wid: str, gpus: int = 0, *, slots: int | None = None,
               caps: dict[str, Any] | None = None) -> None:
    inv = Inventory("host", [{"index": i, "name": "H100", "memory_mb": 81559}
                             for i in range(gpus)], 8,
                    {"cuda": gpus > 0, "bf16": True, "max_machines": 1, **(caps or {})},
                    slots or max(1, gpus))
    with session_scope() as s:
        register(s, wid, inv)


_tenants: dict[str, str] = {}


def add_job(gpus: int = 1, *, tenant: str = "acme", priority: int = 0, age: float = 0.0,
            limit: int | None = None, **spec: Any) -> str:
    """A queued job of ``gpus`` processes, created ``age`` seconds ago, with a time limit of
    ``limit`` seconds (resources.timeout_seconds) if given."""
    dist = {"strategy": "ddp", "num_processes": gpus} if gpus > 1 else {}
    body = {"name": "fake:succeed", "model": {"name_or_path": "/m"},
            "dataset": {"path": "/d.jsonl"}, "priority": priority,
            "distributed": dist, "resources": {"timeout_seconds": limit}, **spec}
    now = utcnow()
    with session_scope() as s:
        tid = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        if tid is None:
            t = Tenant(name=tenant)
            s.add(t)
            s.flush()
            tid = t.id
        job = Job(tenant_id=tid, name="fake:succeed", spec=body, priority=priority,
                  status=JobStatus.queued, created_at=now - timedelta(seconds=age),
                  queued_at=now)
        s.add(job)
        s.flush()
        return job.id


def finish(claim: Claim, to: JobStatus = JobStatus.succeeded) -> None:
    with session_scope() as s:
        assert jobstate.finish(s, claim.job_id, holder(claim), previous=JobStatus.running,
                               to=to, now=utcnow())


def allocations() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    with session_scope() as s:
        for a in s.scalars(select(GpuAllocation).order_by(GpuAllocation.gpu_index)):
            out.setdefault(a.job_id or f"{a.deployment_id}", []).append(a.gpu_index)
    return out


def test_priority_first_then_first_come_first_served(env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=1)
    old = add_job(age=30)
    urgent = add_job(priority=5)
    new = add_job(age=10)

    order = []
    for _ in range(3):
        claim = claim_next(settings, "w1")
        assert claim is not None
        assert claim_next(settings, "w1") is None  # its only GPU is taken
        order.append(claim.job_id)
        finish(claim)

    assert order == [urgent, old, new]


def test_jobs_get_disjoint_gpus_and_only_what_fits(env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=4)
    a, b, c = add_job(2, age=3), add_job(2, age=2), add_job(1, age=1)

    first, second = claim_next(settings, "w1"), claim_next(settings, "w1")

    assert first is not None and second is not None
    assert (first.job_id, first.gpu_ids) == (a, (0, 1))
    assert (second.job_id, second.gpu_ids) == (b, (2, 3))
    assert claim_next(settings, "w1") is None
    assert allocations() == {a: [0, 1], b: [2, 3]}
    finish(first)
    third = claim_next(settings, "w1")
    assert third is not None and (third.job_id, third.gpu_ids) == (c, (0,))


def test_a_job_too_large_for_the_free_gpus_lets_a_smaller_one_through(
        env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="3600")
    add_worker("w1", gpus=4)
    add_worker("w2", gpus=4)
    add_job(1, age=50)
    assert claim_next(settings, "w1") is not None
    add_job(4, age=40)  # fits w2's 4 free GPUs, not w1's 3
    small = add_job(1, age=1)

    claim = claim_next(settings, "w1")

    assert claim is not None and claim.job_id == small  # backfill: w1's GPUs do not idle


def test_a_starving_large_job_reserves_a_worker(env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60")
    add_worker("w1", gpus=4)
    add_job(1, age=600)
    running = claim_next(settings, "w1")
    assert running is not None
    big = add_job(4, age=120)  # waited past reserve_after_seconds, fits nowhere now
    add_job(1, age=5)

    # w1 is held for the big job: the small one behind it may not take the free GPUs.
    assert claim_next(settings, "w1") is None

    finish(running)
    claim = claim_next(settings, "w1")
    assert claim is not None and (claim.job_id, claim.gpu_ids) == (big, (0, 1, 2, 3))


def claimed(settings: Settings, worker_id: str) -> str:
    claim = claim_next(settings, worker_id)
    assert claim is not None
    return claim.job_id


def test_a_job_that_ends_before_the_reserved_job_could_start_backfills_its_worker(
        env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60", FTUNE_CANCEL_GRACE_SECONDS="5")
    add_worker("w1", gpus=4)
    add_job(1, age=600, limit=600)
    claimed(settings, "w1")  # its GPU is free in 605 s at the latest
    add_job(4, age=120)  # reserved on w1: it cannot start before the running job ends
    add_job(1, age=20, limit=3600)  # would hold a GPU past that: may not start
    add_job(1, age=10)  # no time limit: neither
    short = add_job(1, age=5, limit=300)  # stopped 305 s from now at the latest

    assert claimed(settings, "w1") == short
    assert claim_next(settings, "w1") is None


def six_of_eight_gpus_reserved(env: Callable[..., Settings]) -> Settings:
    """w1 (8 GPUs) runs a 4-GPU job with a time limit, and a 6-GPU job that has waited past
    reserve_after_seconds is reserved on it: it will need 6 of its 8 GPUs, 2 stay spare."""
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60")
    add_worker("w1", gpus=8)
    add_job(4, age=600, limit=600)
    claimed(settings, "w1")
    add_job(6, age=120)
    return settings


def test_a_job_on_gpus_the_reserved_job_leaves_spare_backfills_without_a_limit(
        env: Callable[..., Settings]) -> None:
    settings = six_of_eight_gpus_reserved(env)
    add_job(3, age=20)  # no time limit, more than the spare GPUs: may not start
    two = add_job(2, age=10)  # no time limit, fits in the spare GPUs

    assert claimed(settings, "w1") == two
    assert claim_next(settings, "w1") is None  # nothing spare any more


def test_jobs_ahead_of_the_reserved_job_start_first_and_count_in_its_bound(
        env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60", FTUNE_CANCEL_GRACE_SECONDS="5")
    add_worker("w1", gpus=4)
    add_job(2, age=900, limit=600)
    claimed(settings, "w1")
    ahead = add_job(2, age=200, limit=3600)  # fits now, and comes first
    big = add_job(4, age=100)  # fits nowhere: reserves w1

    claim = claim_next(settings, "w1")
    assert claim is not None and claim.job_id == ahead
    with session_scope() as s:
        state = queue_load.load_state(s, settings, utcnow())
    held = scheduler.plan(state, settings, utcnow()).held
    # Its bound is when the job that started ahead of it is stopped, not the first one.
    assert held is not None and held.job_id == big and held.starts_by is not None
    assert abs((held.starts_by - claim.started_at).total_seconds() - 3605) < 5


def test_the_reservation_goes_where_the_job_can_start_soonest(
        env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60")
    add_worker("w1", gpus=4)
    add_worker("w2", gpus=4)
    add_job(2, age=900, limit=3600)
    claimed(settings, "w1")  # w1: 2 GPUs free now, 4 in an hour
    add_job(3, age=800, limit=600)
    claimed(settings, "w2")  # w2: 1 GPU free now, 4 in ten minutes
    big = add_job(4, age=120)
    small = add_job(1, age=5)

    # The big job is held on w2 (not on w1, which has more free GPUs): w2 starts nothing
    # without a limit; w1 is free to run the small job.
    assert claim_next(settings, "w2") is None
    assert claimed(settings, "w1") == small
    with session_scope() as s:
        state = queue_load.load_state(s, settings, utcnow())
    held = scheduler.plan(state, settings, utcnow()).held
    assert held is not None and (held.job_id, held.worker_id) == (big, "w2")


def test_a_reserved_job_says_by_when_it_starts(env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_RESERVE_AFTER_SECONDS="60", FTUNE_CANCEL_GRACE_SECONDS="5")
    add_worker("w1", gpus=2)
    add_job(1, age=600, limit=600)
    running = claim_next(settings, "w1")
    assert running is not None
    big = add_job(2, age=120)

    with session_scope() as s:
        now = utcnow()
        why = queue_wait.waiting(queue_load.load_state(s, settings, now), big, settings, now)

    assert why is not None and why.waiting_for == "gpus"
    by = running.started_at + timedelta(seconds=605)
    assert f"starts by {by.isoformat(timespec='seconds')} at the latest" in why.message


def test_a_job_is_planned_where_it_fits_most_tightly_but_an_asking_worker_takes_it(
        env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=4)
    add_worker("w2", gpus=2)
    small = add_job(1)

    with session_scope() as s:
        state = queue_load.load_state(s, settings, utcnow())
    # Best fit: the plan puts it on w2 (w1 stays whole for a 4-GPU job), so a run's end
    # rings w2...
    assert scheduler.workers_with_work(state, settings, utcnow()) == ["w2"]
    # ...but a worker that asks is alive, and w2 may have died a moment ago: w1 takes it.
    assert claimed(settings, "w1") == small


def test_an_asking_worker_takes_no_gpus_the_plan_gave_another_job(
        env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=4)
    add_worker("w2", gpus=2)
    add_job(2, age=20)  # planned on w2 (tightest)
    whole = add_job(4, age=10)  # fits only w1

    # Taking the 2-GPU job would leave the 4-GPU job nowhere to go.
    assert claimed(settings, "w1") == whole


def test_backfill_planned_on_a_reserved_worker_stays_within_its_spare_gpus(
        env: Callable[..., Settings]) -> None:
    settings = six_of_eight_gpus_reserved(env)
    first, second, _third = (add_job(1, age=age) for age in (30, 20, 10))  # no time limits

    with session_scope() as s:
        state = queue_load.load_state(s, settings, utcnow())
    planned = scheduler.plan(state, settings, utcnow())

    assert [p.job_id for _, p in planned.starts] == [first, second]
    assert planned.held is not None and planned.held.spare_gpus == 0


def test_gpus_freed_together_fill_together(env: Callable[..., Settings],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import core.jobs.dispatch

    rung: list[str] = []
    monkeypatch.setattr(core.jobs.dispatch, "ring_worker", rung.append)
    settings = env()
    add_worker("w1", gpus=4)
    for age in (30, 20, 10):
        add_job(1, age=age)

    # A claim that leaves room for the next job rings its own worker again; the last one
    # (nothing left to start) does not.
    for expected in (["w1"], ["w1", "w1"], ["w1", "w1"]):
        assert claim_next(settings, "w1", own_bell=True) is not None
        assert rung == expected


def test_an_own_doorbell_without_room_takes_no_decision(
        env: Callable[..., Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    import core.jobs.dispatch

    rung: list[str] = []
    monkeypatch.setattr(core.jobs.dispatch, "ring_worker", rung.append)
    settings = env()
    add_worker("w1", gpus=1)
    add_worker("w2", gpus=1)
    add_job(1, age=20)
    claimed(settings, "w1")
    add_job(1, age=10)  # fits w2 only

    def decisions() -> int:
        with session_scope() as s:
            return s.get_one(SchedulerLock, 1, populate_existing=True).decisions

    before = decisions()
    assert claim_next(settings, "w1", own_bell=True) is None
    assert (decisions(), rung) == (before, [])  # no lock taken, nothing forwarded
    # A submission's doorbell that reached the full worker is forwarded to w2.
    assert claim_next(settings, "w1") is None
    assert rung == ["w2"]


def test_tenant_limits_on_running_jobs_and_gpus(env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_TENANT_MAX_RUNNING_JOBS="1",
                   FTUNE_TENANT_LIMITS='{"big": {"max_running_jobs": 5, "max_gpus": 3}}')
    add_worker("w1", gpus=8)
    a1, a2 = add_job(1, tenant="acme", age=9), add_job(1, tenant="acme", age=8)
    b1, b2 = add_job(2, tenant="big", age=7), add_job(2, tenant="big", age=6)
    other = add_job(1, tenant="other", age=5)

    claimed = []
    while (claim := claim_next(settings, "w1")) is not None:
        claimed.append(claim.job_id)

    # acme: one running job; big: 2 of its 3 GPUs held, the next 2-GPU job would make 4.
    assert claimed == [a1, b1, other]
    assert {a2, b2}.isdisjoint(claimed)


def test_a_draining_worker_takes_nothing(env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=2)
    add_job(1)
    with session_scope() as s:
        s.execute(update(Worker).values(state=WorkerState.draining))

    assert claim_next(settings, "w1") is None


def test_a_job_no_worker_can_run_fails_or_waits_as_the_operator_chose(
        env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=2)
    job = add_job(4)  # admitted before this fleet registered

    claim = claim_next(settings, "w1")  # claimed without GPUs: the run fails it
    assert claim is not None and (claim.job_id, claim.gpu_ids) == (job, ())

    settings = env(FTUNE_QUEUE_UNRUNNABLE="true")
    add_job(4)
    assert claim_next(settings, "w1") is None  # it waits for a worker that can run it


def test_cpu_worker_slots_are_allocated_like_gpus(env: Callable[..., Settings]) -> None:
    settings = env(FTUNE_WORKER_GPUS="0")
    add_worker("cpu", gpus=0, slots=2)
    jobs = [add_job(1, age=3 - i) for i in range(3)]

    first, second = claim_next(settings, "cpu"), claim_next(settings, "cpu")

    assert first is not None and second is not None
    assert (first.cpu_slot, second.cpu_slot, first.cpu_slots) == (0, 1, 2)
    assert claim_next(settings, "cpu") is None
    assert allocations() == {jobs[0]: [-1], jobs[1]: [-2]}


def test_concurrent_claims_never_share_a_gpu_or_a_job(env: Callable[..., Settings]) -> None:
    settings = env()
    for w in ("w1", "w2"):
        add_worker(w, gpus=4)
    for i in range(12):
        add_job(1 + i % 2, age=100 - i)
    claims: list[Claim] = []
    lock = threading.Lock()
    start = threading.Barrier(12)

    def claimer(wid: str) -> None:
        start.wait()
        claim = claim_next(settings, wid)
        if claim is not None:
            with lock:
                claims.append(claim)

    threads = [threading.Thread(target=claimer, args=(f"w{1 + i % 2}",)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)

    held = [(c.worker_id, g) for c in claims for g in c.gpu_ids]
    assert len(held) == len(set(held)) == 8  # every GPU of both workers, each once
    assert len({c.job_id for c in claims}) == len(claims)
    with session_scope() as s:
        running = set(s.scalars(select(Job.id).where(Job.status == JobStatus.running)))
    assert running == {c.job_id for c in claims}


def test_every_way_out_of_running_frees_exactly_that_jobs_gpus(
        env: Callable[..., Settings]) -> None:
    settings = env()
    add_worker("w1", gpus=8)
    for _ in range(4):
        add_job(2)
    claims = [claim_next(settings, "w1") for _ in range(4)]
    assert all(c is not None for c in claims)
    done, cancelled, requeued, lost = (c for c in claims if c is not None)
    now = utcnow()

    finish(done)
    assert done.job_id not in allocations() and len(allocations()) == 3
    with session_scope() as s:
        jobstate.request_cancel(s, cancelled.job_id, previous=JobStatus.running, now=now)
        jobstate.honour_cancel_running(s, cancelled.job_id, holder(cancelled))
    assert cancelled.job_id in allocations()  # still stopping: its GPUs are still busy
    with session_scope() as s:
        jobstate.finish(s, cancelled.job_id, holder(cancelled), previous=JobStatus.cancelling,
                        to=JobStatus.cancelled, now=now)
        jobstate.requeue(s, requeued.job_id, holder(requeued), previous=JobStatus.running,
                         why="worker shutting down", now=now)
        jobstate.lose(s, lost.job_id, previous=JobStatus.running, attempt=lost.attempt,
                      to=JobStatus.queued, stale_before=now + timedelta(seconds=1), now=now,
                      message="worker lost")
    assert allocations() == {}


def test_the_reconciler_marks_silent_workers_lost_and_frees_their_jobs_gpus(
        env: Callable[..., Settings]) -> None:
    from worker.upkeep.reconciler import reconcile

    settings = env(FTUNE_RECONCILE_INTERVAL_SECONDS="3600")
    add_worker("gone", gpus=2)
    add_worker("alive", gpus=2)
    add_job(2)
    add_job(2)
    on_gone, on_alive = claim_next(settings, "gone"), claim_next(settings, "alive")
    assert on_gone is not None and on_alive is not None
    long_ago = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds + 5)
    with session_scope() as s:
        s.execute(update(Worker).where(Worker.id == "gone").values(heartbeat_at=long_ago))
        s.execute(update(Job).where(Job.id == on_gone.job_id).values(heartbeat_at=long_ago))

    counts = reconcile()

    assert counts["workers_lost"] == 1 and counts["requeued"] == 1
    assert allocations() == {on_alive.job_id: [0, 1]}
    with session_scope() as s:
        assert s.get_one(Worker, "gone").state == WorkerState.lost
    # Nothing is placed on a lost worker; the requeued job goes where there is room.
    assert claim_next(settings, "alive") is None
