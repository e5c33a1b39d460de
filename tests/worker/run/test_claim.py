"""The claim: queued -> running for exactly one caller, on PostgreSQL."""

from __future__ import annotations

import threading

from core.db.models import JobStatus, utcnow
from tests.utils.worker import WorkerEnv, get_job, job_spec, make_job, set_job, statuses
from worker.run.claim import Claim, claim_job


def _spec(w: WorkerEnv) -> dict:
    return job_spec(w.model_root, path=w.data_root / "x.jsonl")


def test_concurrent_claims_have_exactly_one_winner(pg_wenv: WorkerEnv) -> None:
    jobs = [make_job(_spec(pg_wenv)) for _ in range(10)]
    for job_id in jobs:
        barrier = threading.Barrier(4)
        results: dict[str, Claim | None] = {}

        def claim(worker: str, job_id: str = job_id, barrier: threading.Barrier = barrier,
                  results: dict[str, Claim | None] = results) -> None:
            barrier.wait()
            results[worker] = claim_job(job_id, worker, max_attempts=3)

        threads = [threading.Thread(target=claim, args=(f"w{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        winners = [w for w, c in results.items() if c is not None]
        assert len(winners) == 1, results
        job = get_job(job_id)
        assert (job.status, job.worker_id, job.attempt) == (JobStatus.running, winners[0], 1)
        assert statuses(job_id) == ["running"]
        set_job(job_id, status=JobStatus.succeeded)  # leave nothing for other tests' reconciler


def test_claim_keeps_first_started_at_and_counts_attempts(pg_wenv: WorkerEnv) -> None:
    first = utcnow().replace(microsecond=0)
    job_id = make_job(_spec(pg_wenv), attempt=1, started_at=first)

    claim = claim_job(job_id, "w1", max_attempts=3)

    assert claim is not None and claim.attempt == 2 and claim.started_at == first
    set_job(job_id, status=JobStatus.succeeded)


def test_cancelled_job_is_not_claimed(pg_wenv: WorkerEnv) -> None:
    job_id = make_job(_spec(pg_wenv), status=JobStatus.cancelled)

    assert claim_job(job_id, "w1", max_attempts=3) is None
    assert get_job(job_id).status == JobStatus.cancelled


def test_queued_job_with_cancel_request_becomes_cancelled(pg_wenv: WorkerEnv) -> None:
    job_id = make_job(_spec(pg_wenv), cancel_requested_at=utcnow())

    assert claim_job(job_id, "w1", max_attempts=3) is None
    assert get_job(job_id).status == JobStatus.cancelled
    assert statuses(job_id) == ["cancelled"]


def test_a_spec_resized_while_paused_is_the_one_claimed(wenv: WorkerEnv) -> None:
    """Workers parse each queued spec once, but POST /resume may change it while the job is
    paused: the claim after the resume runs the new one, not the one parsed before."""
    from core.db.session import session_scope
    from core.jobs import queue_load
    from core.jobs import state as jobstate

    spec = _spec(wenv)
    spec["distributed"] = {"strategy": "ddp", "num_processes": 2}
    job_id = make_job(spec)
    with session_scope() as s:
        (queued,) = queue_load.load_state(s, wenv.settings, utcnow()).queue
        assert queued.spec is not None and queued.spec.distributed.num_processes == 2
        assert jobstate.request_pause(s, job_id, previous=JobStatus.queued, now=utcnow())
    set_job(job_id, spec={**spec, "distributed": {"strategy": "none", "num_processes": 1}})
    with session_scope() as s:
        assert jobstate.resume(s, job_id, now=utcnow())
    claim = claim_job(job_id, "w1", max_attempts=3)
    assert claim is not None and claim.spec is not None
    assert claim.spec.distributed.num_processes == 1
