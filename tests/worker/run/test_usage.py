"""Usage recorded by a real worker run (the fake trainer reports tokens as core.train does):
one attempt row per attempt, closed by the move that ends it; tokens attributed to the
attempt that trained them; the spec that ran and the launch agree."""

from __future__ import annotations

from datetime import timedelta

import yaml
from sqlalchemy import select

from core.db.models import JobAttempt, JobStatus, utcnow
from core.db.session import session_scope
from core.jobs import state as jobstate
from core.jobs.state import RunOutcome
from core.jobs.usage import job_totals
from core.spec import parse_job_spec, resolved_spec
from testkit.fake_trainer import LOSS_TOKENS_PER_STEP, TOKENS_PER_STEP
from testkit.wait import wait_until
from tests.utils.threads import Background
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job, set_job
from worker.run.local import run_job


def attempts(job_id: str) -> list[JobAttempt]:
    with session_scope() as s:
        rows = list(s.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id)
                              .order_by(JobAttempt.attempt)))
        for r in rows:
            s.expunge(r)
        return rows


def test_a_lost_then_resumed_job_counts_each_attempt(wenv: WorkerEnv, direct: None) -> None:
    # 30 steps of 0.2 s: the first attempt must still be training when the test loses it
    # (step 2 is seen through the worker's ingestion, which lags by seconds on a loaded
    # machine); had it reached the end, its stop checkpoint would be the last step and the
    # second attempt would train none.
    job_id = fake_job(wenv, "train", training={"max_steps": 30, "save_steps": 100})
    spec = get_job(job_id).spec
    set_job(job_id, resolved_spec=resolved_spec(parse_job_spec(spec)))
    first = Background(lambda: run_job(job_id))
    wait_until(lambda: get_job(job_id).step >= 2, 60, "step 2", every=0.05,
               give_up=lambda: not first.thread.is_alive() and "the run ended first")
    # The reconciler's move for a worker gone silent: the job is queued again.
    with session_scope() as s:
        assert jobstate.lose(s, job_id, previous=JobStatus.running, attempt=1,
                             to=JobStatus.queued, stale_before=utcnow() + timedelta(hours=1),
                             now=utcnow(), message="worker went silent (test)")
    assert first.join(60) == RunOutcome.lost
    one = attempts(job_id)
    # A lost attempt ends at its worker's last heartbeat (not later, when it was noticed).
    assert len(one) == 1 and one[0].ended_at is not None
    lost_event = events_of(job_id, "status")[-1]
    assert lost_event.data["status"] == "queued"
    assert one[0].ended_at < lost_event.created_at

    assert run_job(job_id) == JobStatus.succeeded

    rows = attempts(job_id)
    assert [(a.attempt, a.processes, a.device) for a in rows] == [(1, 1, "cpu"), (2, 1, "cpu")]
    assert rows[0].ended_at == one[0].ended_at  # closed once, by the lose move
    progress = events_of(job_id, "progress")
    for a in rows:
        steps = sum(1 for e in progress if e.data.get("attempt") == a.attempt)
        assert steps > 0
        assert (a.tokens, a.loss_tokens) == (TOKENS_PER_STEP * steps,
                                             LOSS_TOKENS_PER_STEP * steps)
        assert a.ended_at is not None and a.started_at < a.ended_at
    total = job_totals(rows, now=utcnow())
    assert total.attempts == 2 and total.tokens == sum(a.tokens for a in rows)
    assert total.wall_seconds >= 30 * 0.2  # 30 steps of 0.2 s, over both attempts
    assert total.gpu_seconds == total.wall_seconds  # one process

    job = get_job(job_id)
    assert job.run_info is not None and job.resolved_spec is not None
    assert job.run_info["attempt"] == 2 and job.run_info["total_steps"] == 30
    assert job.run_info["worker_id"] == rows[1].worker_id
    assert job.resolved_spec["peft"]["target_modules"] == ["q_proj", "v_proj"]


def test_the_launch_agrees_with_the_spec_that_ran(wenv: WorkerEnv) -> None:
    job_id = fake_job(wenv, "train", training={"max_steps": 2, "save_steps": 100})
    assert run_job(job_id) == JobStatus.succeeded
    job = get_job(job_id)
    spec = parse_job_spec(job.spec)
    assert job.launch is not None and job.run_info is not None
    launched = yaml.safe_load(job.launch["accelerate_yaml"])
    assert launched["num_processes"] == job.run_info["world_size"] == 1
    assert launched["mixed_precision"] == spec.training.mixed_precision
    (a,) = attempts(job_id)
    assert a.processes == launched["num_processes"] and a.tokens == 2 * TOKENS_PER_STEP
