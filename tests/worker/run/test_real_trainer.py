"""run_job end to end against the real trainer (core.train under `accelerate launch`) on a
tiny causal LM, on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core.db.models import Checkpoint, JobAttempt, JobStatus
from core.db.session import session_scope
from core.run.jobdir import JobDir
from tests.utils.threads import act_when
from tests.utils.tiny import text_rows, write_jsonl
from tests.utils.worker import WorkerEnv, events_of, get_job, make_job, statuses
from worker.run import process_tree
from worker.run.adapter_check import adapter_problem
from worker.run.local import run_job

pytestmark = pytest.mark.slow


def test_run_job_trains_a_tiny_llama_with_the_real_trainer(
        tiny_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str) -> None:
    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train")
    data = write_jsonl(w.data_root / "train.jsonl", text_rows(32))
    job_id = make_job({
        "name": "real",
        "model": {"name_or_path": str(tiny_causal_lm), "task": "causal_lm"},
        "dataset": {"path": str(data), "format": "text", "max_seq_length": 32},
        "peft": {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "training": {"max_steps": 4, "learning_rate": 5e-3, "per_device_train_batch_size": 4,
                     "logging_steps": 1, "save_steps": 2, "seed": 0},
        "tracking": {"report_to": ["tensorboard"]},
    })

    result = run_job(job_id)

    jd = JobDir(w.settings.jobs_dir / job_id)
    log_tail = jd.log.read_text()[-3000:] if jd.log.exists() else ""
    job = get_job(job_id)
    assert result == JobStatus.succeeded, f"{job.error_code}: {job.error_message}\n{log_tail}"
    assert job.adapter_path == str(jd.adapter) and adapter_problem(jd.adapter) is None
    assert (job.step, job.total_steps) == (4, 4)
    assert job.train_loss is not None and job.training_started_at is not None
    assert job.peak_memory_mb is not None and job.peak_memory_mb > 0
    assert statuses(job_id) == ["running", "succeeded"]
    types = {e.type for e in events_of(job_id)}
    assert {"started", "progress", "checkpoint", "saved", "finished"} <= types
    with session_scope() as s:
        steps = sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    assert steps and set(steps) <= {2, 4}
    assert job.launch is not None and job.launch["argv"][-2:] == ["core.train", str(jd.root)]
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
    # Usage: the attempt holds what the trainer reported, and the run info what it ran.
    (finished,) = [e.data for e in events_of(job_id, "finished")]
    with session_scope() as s:
        (attempt,) = s.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id)).all()
        assert (attempt.processes, attempt.device) == (1, "cpu")
        assert attempt.tokens == finished["tokens_trained"] > 0
        assert 0 < attempt.loss_tokens == finished["loss_tokens_trained"] < attempt.tokens
        assert attempt.ended_at is not None and attempt.ended_at > attempt.started_at
    assert job.run_info is not None
    assert (job.run_info["total_steps"], job.run_info["world_size"]) == (4, 1)
    assert job.run_info["worker_id"] == job.worker_id
    # Tracking resolved by the worker, run by the trainer, linked on the job row.
    assert job.tracking == {"tensorboard": {"logdir": "tensorboard"}}
    assert list((jd.root / "tensorboard").glob("events.out.tfevents.*"))


def test_cancel_stops_the_real_trainer_gracefully(
        tiny_causal_lm: Path, tmp_path: Path, configure, sqlite_url: str) -> None:

    from core.db.models import utcnow
    from tests.utils.worker import set_job

    w: WorkerEnv = configure(tmp_path, sqlite_url,
                             FTUNE_ALLOWED_MODEL_ROOTS=str(tiny_causal_lm.parent),
                             FTUNE_TRAINER_MODULE="core.train", FTUNE_CANCEL_GRACE_SECONDS="30")
    data = write_jsonl(w.data_root / "train.jsonl", text_rows(64))
    job_id = make_job({
        "name": "real-cancel",
        "model": {"name_or_path": str(tiny_causal_lm), "task": "causal_lm"},
        "dataset": {"path": str(data), "format": "text", "max_seq_length": 32},
        "peft": {"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "training": {"max_steps": 100_000, "per_device_train_batch_size": 2,
                     "logging_steps": 1, "save_steps": 100_000},
    })

    def at_step_3_or_ended() -> object:
        job = get_job(job_id)
        return job if job.status not in (JobStatus.running, JobStatus.queued) \
            or job.step >= 3 else None

    def cancel(job: Any) -> None:
        if job.status == JobStatus.running:  # otherwise the run's own asserts say why
            set_job(job_id, status=JobStatus.cancelling, cancel_requested_at=utcnow())

    t = act_when(at_step_3_or_ended, cancel, 120, "step 3", every=0.1)
    result = run_job(job_id)
    t.join()

    jd = JobDir(w.settings.jobs_dir / job_id)
    job = get_job(job_id)
    assert result == JobStatus.cancelled, f"{job.error_code}: {job.error_message}"
    assert job.step >= 3 and job.adapter_path is None and not jd.adapter.exists()
    stopped = events_of(job_id, "stopped")
    assert stopped, "the trainer honoured the stop request"
    # ...and saved a checkpoint where it stopped, which the job lists.
    stop_step = stopped[0].data["step"]
    assert stopped[0].data["checkpoint"] == f"checkpoints/checkpoint-{stop_step}"
    assert jd.latest_checkpoint() == jd.checkpoints / f"checkpoint-{stop_step}"
    with session_scope() as s:
        steps = list(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    assert steps == [stop_step]
    assert process_tree.tagged_prefix(f"{job_id}:") == set()
