"""The reconciler: lost workers, lost messages, and cancels nobody enforces."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from core.db.models import JobStatus, utcnow
from tests.utils.worker import (
    WorkerEnv,
    ago,
    events_of,
    get_job,
    job_spec,
    make_job,
    set_job,
    statuses,
)
from worker.upkeep.reconciler import reconcile


@pytest.fixture
def enqueued(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    import core.jobs.dispatch

    calls: list[str] = []
    lock = threading.Lock()

    def record(job_id: str) -> None:
        with lock:
            calls.append(job_id)

    monkeypatch.setattr(core.jobs.dispatch, "enqueue_job", record)
    return calls


def _running(w: WorkerEnv, *, heartbeat_age: float, attempt: int = 1,
             status: str = JobStatus.running) -> str:
    return make_job(job_spec(w.model_root, path=w.data_root / "x.jsonl"), status=status,
                    worker_id="gone-worker", attempt=attempt, started_at=ago(600),
                    heartbeat_at=ago(heartbeat_age))


def test_stale_heartbeat_is_requeued_and_enqueued(wenv: WorkerEnv, enqueued: list[str]) -> None:
    stale = _running(wenv, heartbeat_age=wenv.settings.heartbeat_timeout_seconds + 5)
    fresh = _running(wenv, heartbeat_age=1)

    result = reconcile()

    assert result["requeued"] == 1 and enqueued == [stale]
    job = get_job(stale)
    assert (job.status, job.worker_id, job.attempt) == (JobStatus.queued, None, 1)
    assert job.queued_at is not None and job.queued_at > ago(5)
    requeued = events_of(stale, "requeued")
    assert len(requeued) == 1 and "gone-worker" in requeued[0].message
    assert statuses(stale) == ["queued"]
    assert get_job(fresh).status == JobStatus.running


def test_stale_heartbeat_on_last_attempt_fails_worker_lost(wenv: WorkerEnv,
                                                           enqueued: list[str]) -> None:
    job_id = _running(wenv, heartbeat_age=3600, attempt=wenv.settings.max_attempts)

    assert reconcile()["failed"] == 1

    job = get_job(job_id)
    assert (job.status, job.error_code) == (JobStatus.failed, "worker_lost")
    assert job.finished_at is not None and enqueued == []


def test_requeue_then_lose_again_until_max_attempts(wenv: WorkerEnv, enqueued: list[str]) -> None:
    from worker.run.claim import claim_job

    job_id = _running(wenv, heartbeat_age=3600, attempt=1)
    for attempt in range(2, wenv.settings.max_attempts + 1):
        reconcile()
        claim = claim_job(job_id, f"w{attempt}", max_attempts=wenv.settings.max_attempts)
        assert claim is not None and claim.attempt == attempt
        # This worker dies too: its heartbeat goes stale.
        reconcile(now=utcnow() + timedelta(seconds=3600))

    job = get_job(job_id)
    assert (job.status, job.error_code) == (JobStatus.failed, "worker_lost")
    assert len(enqueued) == wenv.settings.max_attempts - 1


def test_queued_too_long_is_sent_again(wenv: WorkerEnv, enqueued: list[str]) -> None:
    old = make_job(job_spec(wenv.model_root, path=wenv.data_root / "x.jsonl"))
    new = make_job(job_spec(wenv.model_root, path=wenv.data_root / "x.jsonl"))
    set_job(old, queued_at=ago(wenv.settings.queued_requeue_seconds + 10))

    assert reconcile()["reenqueued"] == 1
    assert enqueued == [old]
    assert get_job(old).queued_at > ago(5)
    assert reconcile()["reenqueued"] == 0  # bumped: not again until it is stale again
    assert get_job(new).status == get_job(old).status == JobStatus.queued


def test_cancelling_without_live_worker_is_cancelled(wenv: WorkerEnv,
                                                      enqueued: list[str]) -> None:
    job_id = _running(wenv, heartbeat_age=3600, status=JobStatus.cancelling)

    assert reconcile()["cancelled"] == 1

    assert get_job(job_id).status == JobStatus.cancelled
    assert enqueued == []


def test_concurrent_reconcilers_requeue_once(pg_wenv: WorkerEnv, enqueued: list[str]) -> None:
    jobs = [_running(pg_wenv, heartbeat_age=3600) for _ in range(5)]
    barrier = threading.Barrier(4)

    def run() -> None:
        barrier.wait()
        reconcile()

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    for job_id in jobs:
        assert get_job(job_id).status == JobStatus.queued
        assert len(events_of(job_id, "requeued")) == 1
        assert enqueued.count(job_id) == 1


def test_pausing_without_live_worker_is_paused_and_not_enqueued(
        wenv: WorkerEnv, enqueued: list[str]) -> None:
    job_id = _running(wenv, heartbeat_age=3600, status=JobStatus.pausing)

    assert reconcile()["paused"] == 1

    job = get_job(job_id)
    assert (job.status, job.worker_id, job.finished_at) == (JobStatus.paused, None, None)
    # Its worker ended the attempt, not the user: it still counts against the budget.
    assert job.pauses == 0
    (event,) = events_of(job_id, "status")
    assert (event.data["previous"], event.data["status"]) == ("pausing", "paused")
    assert "gone-worker" in event.data["reason"]
    assert enqueued == []
