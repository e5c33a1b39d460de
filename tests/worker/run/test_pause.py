"""Pause and resume through the worker (run_job under a real `accelerate launch`, the fake
trainer's resumable mode): a pause stops the whole process tree at a checkpoint and frees
the worker; a resumed job continues from that checkpoint, on any worker."""

from __future__ import annotations

import json
from datetime import timedelta

import psutil
import pytest

from core.db.models import JobStatus, utcnow
from core.db.session import session_scope
from core.jobs import state as jobstate
from core.run.jobdir import JobDir
from testkit.wait import wait_until
from tests.utils.threads import Background, act_when
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job, set_job, statuses
from worker.run import process_tree
from worker.run.local import run_job


def request_pause_when(job_id: str, step: int) -> Background:
    """What POST /pause does, once the running job has logged ``step``."""

    def pause(_: object) -> None:
        with session_scope() as s:
            assert jobstate.request_pause(s, job_id, previous=JobStatus.running, now=utcnow())

    return act_when(lambda: (job := get_job(job_id)).status == JobStatus.running
                    and job.step >= step, pause, 60, f"the job to run step {step}")


def test_pause_stops_the_tree_at_a_checkpoint_and_resume_finishes(
        wenv: WorkerEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = fake_job(wenv, "train", training={"max_steps": 30, "save_steps": 100})
    jd = JobDir(wenv.settings.jobs_dir / job_id)

    t = request_pause_when(job_id, 3)
    assert run_job(job_id) == JobStatus.paused
    t.join()

    job = get_job(job_id)
    assert (job.status, job.worker_id, job.finished_at) == (JobStatus.paused, None, None)
    assert (job.attempt, job.pauses) == (1, 1)
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    trainer_pid = int(json.loads((jd.root / "pids.json").read_text())["trainer"])
    assert not psutil.pid_exists(trainer_pid) or \
        psutil.Process(trainer_pid).status() == psutil.STATUS_ZOMBIE
    (stopped,) = events_of(job_id, "stopped")
    stop_step = stopped.data["step"]
    assert 3 <= stop_step < 30
    assert jd.latest_checkpoint() == jd.checkpoints / f"checkpoint-{stop_step}"
    paused = events_of(job_id, "status")[-1]
    assert paused.data["checkpoint_step"] == stop_step
    assert statuses(job_id) == ["running", "pausing", "paused"]

    with session_scope() as s:
        assert jobstate.resume(s, job_id, now=utcnow())
    monkeypatch.setenv("FTUNE_WORKER_ID", "another-worker")  # any worker continues it
    wenv.reload()
    assert run_job(job_id) == JobStatus.succeeded

    job = get_job(job_id)
    assert (job.attempt, job.pauses, job.step) == (2, 1, 30)
    assert job.worker_id == "another-worker"
    started = events_of(job_id, "started")
    assert started[-1].data["resumed_from"] == f"checkpoints/checkpoint-{stop_step}"
    steps = [e.data["step"] for e in events_of(job_id, "progress")]
    assert steps == list(range(1, 31))  # the second attempt went on from stop_step
    assert statuses(job_id) == ["running", "pausing", "paused", "queued", "running",
                                "succeeded"]
    assert process_tree.tagged_prefix(f"{job_id}:") == set()


def test_a_cancel_while_pausing_wins(wenv: WorkerEnv, direct: None,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # A trainer that ignores the graceful stop keeps the job pausing for the whole grace
    # period: the user cancels meanwhile.
    monkeypatch.setenv("FTUNE_CANCEL_GRACE_SECONDS", "3")
    wenv.reload()
    job_id = fake_job(wenv, "stubborn")
    jd = JobDir(wenv.settings.jobs_dir / job_id)

    def pause_then_cancel() -> None:
        wait_until(lambda: get_job(job_id).step >= 2, 60, "step 2", every=0.05)
        with session_scope() as s:
            assert jobstate.request_pause(s, job_id, previous=JobStatus.running, now=utcnow())
        # The worker has begun stopping the run.
        wait_until(jd.stop.exists, 60, "the stop file", every=0.05)
        with session_scope() as s:
            assert jobstate.request_cancel(s, job_id, previous=JobStatus.pausing, now=utcnow())

    t = Background(pause_then_cancel)
    assert run_job(job_id) == JobStatus.cancelled
    t.join()

    job = get_job(job_id)
    assert (job.status, job.pauses) == (JobStatus.cancelled, 0)
    assert statuses(job_id) == ["running", "pausing", "cancelling", "cancelled"]
    assert process_tree.tagged_prefix(f"{job_id}:") == set()


def test_time_spent_paused_is_not_counted_against_the_time_limit(wenv: WorkerEnv,
                                                                   direct: None) -> None:
    # Started two hours ago with a 60 s limit, but paused for all but 10 s of that.
    job_id = fake_job(wenv, "succeed", resources={"timeout_seconds": 60})
    started = utcnow() - timedelta(hours=2)
    set_job(job_id, attempt=1, pauses=1, started_at=started, paused_seconds=7190.0)

    assert run_job(job_id) == JobStatus.succeeded

    deadline = JobDir(wenv.settings.jobs_dir / job_id).read_spec()["runtime"]["deadline"]
    assert deadline == pytest.approx(started.timestamp() + 7190.0 + 60)
