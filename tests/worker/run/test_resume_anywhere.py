"""Resume anywhere through the worker (real claim, prepare and run on a worker with two
simulated GPUs, the fake trainer's resumable mode): a 2-process job that allows
``distributed.resume_on: [1]`` is paused at a checkpoint; while another job holds one of
the GPUs, its resume starts on the one GPU left, as one process, keeping the checkpoint's
global batch, and a "resized" event says what was chosen and why. The job's stored spec
keeps its own count for later attempts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core.db.models import GpuAllocation, JobAttempt, JobStatus, utcnow
from core.db.session import session_scope
from core.jobs import state as jobstate
from core.run.jobdir import JobDir, read_events
from tests.utils.threads import Background, act_when
from tests.utils.worker import WorkerEnv, events_of, fake_job, get_job
from worker.run.claim import worker_identity
from worker.run.local import run_job

STEPS = 40


def _pause_after_step(jd: JobDir, job_id: str, step: int) -> Background:
    """POST /pause, as soon as the trainer wrote ``step``."""
    def pause(_: object) -> None:
        with session_scope() as s:
            assert jobstate.request_pause(s, job_id, previous=JobStatus.running, now=utcnow())

    return act_when(lambda: any(e["type"] == "progress" and e["step"] >= step
                                for _, e in read_events(jd.events)),
                    pause, 120, f"the trainer to write step {step}", every=0.02)


def _hold_gpu(w: WorkerEnv, index: int) -> str:
    """Another job, running on this worker, holding GPU ``index``."""
    other = fake_job(w, "slow")
    wid = worker_identity(w.settings)
    with session_scope() as s:
        assert jobstate.claim(s, other, worker_id=wid, max_attempts=3, now=utcnow())
        s.add(GpuAllocation(worker_id=wid, gpu_index=index, job_id=other, attempt=1,
                            allocated_at=utcnow()))
    return other


def test_a_paused_two_process_job_resumes_on_the_one_free_gpu(
        tmp_path: Path, configure: Any, direct: None, sqlite_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.run.watch

    monkeypatch.setattr(worker.run.watch, "POLL_SECONDS", 0.05)
    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_FAKE_GPUS="2", FTUNE_WORKER_GPUS="2",
                             FAKE_STEP_SECONDS="0.05")
    job_id = fake_job(w, "train",
                      distributed={"strategy": "ddp", "num_processes": 2, "resume_on": [1]},
                      training={"max_steps": STEPS, "save_steps": 1000,
                                "per_device_train_batch_size": 2})
    jd = JobDir(w.settings.jobs_dir / job_id)

    t = _pause_after_step(jd, job_id, 2)
    assert run_job(job_id) == JobStatus.paused  # on both GPUs
    t.join()
    stop_step = events_of(job_id, "stopped")[0].data["step"]
    ckpt = jd.checkpoints / f"checkpoint-{stop_step}"
    taken = json.loads((ckpt / "ftune_checkpoint.json").read_text())
    assert (taken["world_size"], taken["global_batch"]) == (2, 4)

    _hold_gpu(w, 0)
    with session_scope() as s:
        assert jobstate.resume(s, job_id, now=utcnow())
    assert run_job(job_id) == JobStatus.succeeded

    (resized,) = events_of(job_id, "resized")
    assert resized.data["world_size"] == {"from": 2, "to": 1}
    assert resized.data["strategy"] == {"from": "ddp", "to": "none"}
    assert resized.data["checkpoint"] == ckpt.name and resized.data["gpu_ids"] == [1]
    assert f"{ckpt.name}'s global batch of 4 splits over 1" in resized.message

    plan = json.loads(jd.spec.read_text())  # the run's layout, as the trainer read it
    assert plan["spec"]["distributed"]["num_processes"] == 1
    assert plan["spec"]["distributed"]["strategy"] == "none"
    assert plan["runtime"]["gpu_ids"] == [1]
    started = events_of(job_id, "started")[-1].data
    assert started["resumed_world_size"] == {"from": 2, "to": 1}
    assert started["rebatched"] == {"per_device_train_batch_size": 2,
                                    "gradient_accumulation_steps": 2, "global_batch": 4}
    steps = [e.data["step"] for e in events_of(job_id, "progress")]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and len(steps) == STEPS

    job = get_job(job_id)
    assert job.spec["distributed"] == {"strategy": "ddp", "num_processes": 2,
                                       "resume_on": [1]}  # the next attempt tries 2 again
    with session_scope() as s:
        used = dict(s.execute(select(JobAttempt.attempt, JobAttempt.processes)
                              .where(JobAttempt.job_id == job_id)).all())
    assert used == {1: 2, 2: 1}
