"""events.jsonl -> DB: exactly once, through the stored offset."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import select

from core.db.models import Checkpoint, Job, JobStatus
from core.db.session import session_scope
from tests.utils.worker import WorkerEnv, events_of, get_job, job_spec, make_job
from worker.run.ingest import heartbeat, ingest_events, read_control

LINES: list[dict[str, Any]] = [
    {"time": 1_700_000_000.0, "type": "started", "world_size": 1, "total_steps": 10},
    {"time": 1_700_000_001.0, "type": "progress", "step": 1, "total_steps": 10, "epoch": 0.1,
     "loss": 2.5, "learning_rate": 1e-4, "tokens_per_second": 50.0},
    {"time": 1_700_000_002.0, "type": "progress", "step": 2, "total_steps": 10, "epoch": 0.2,
     "loss": 2.0, "learning_rate": 9e-5, "tokens_per_second": 55.0},
    {"time": 1_700_000_003.0, "type": "checkpoint", "step": 2, "path": "checkpoints/checkpoint-2",
     "metrics": {"loss": 2.0}},
    {"time": 1_700_000_004.0, "type": "memory", "phase": "train", "rank": 0, "cpu_mb_peak": 300.0,
     "gpu_mb_peak": 1200.0},
    {"time": 1_700_000_005.0, "type": "eval", "step": 2, "eval_loss": 2.2},
]


def _write(path: Path, events: list[dict[str, Any]], tail: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events) + tail)


def _job(w: WorkerEnv) -> tuple[str, Path]:
    job_id = make_job(job_spec(w.model_root, path=w.data_root / "x.jsonl"),
                      status=JobStatus.running, worker_id="w1", attempt=1)
    jd = w.settings.jobs_dir / job_id
    jd.mkdir(parents=True)
    return job_id, jd


def _ingest(job_id: str, jd: Path, **guard: Any) -> int:
    with session_scope() as s:
        return ingest_events(s, job_id, jd, **guard)


def test_ingest_is_exactly_once_across_partial_lines_and_rereads(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    events = jd / "events.jsonl"
    _write(events, LINES[:3], tail='{"time": 1700000002.5, "type": "pro')  # writer mid-line

    assert _ingest(job_id, jd) == 3
    assert _ingest(job_id, jd) == 0  # nothing new: nothing duplicated
    offset = get_job(job_id).events_offset
    assert offset == events.stat().st_size - len('{"time": 1700000002.5, "type": "pro')

    # The writer finishes the line, then writes more.
    with open(events, "a") as f:
        f.write('gress", "step": 3, "total_steps": 10, "loss": 1.9}\n')
    _write(events, LINES[3:])
    assert _ingest(job_id, jd) == 4
    assert _ingest(job_id, jd) == 0

    types = [e.type for e in events_of(job_id)]
    assert types == ["started", "progress", "progress", "progress", "checkpoint", "memory", "eval"]
    job = get_job(job_id)
    assert job.events_offset == events.stat().st_size
    assert (job.step, job.total_steps, job.train_loss, job.eval_loss) == (3, 10, 1.9, 2.2)
    assert (job.learning_rate, job.tokens_per_second, job.epoch) == (9e-5, 55.0, 0.2)
    assert job.peak_memory_mb == 1200.0 and job.memory["train"]["cpu_mb_peak"] == 300.0
    assert job.training_started_at is not None
    assert job.training_started_at.timestamp() == 1_700_000_001.0  # the first progress event
    with session_scope() as s:
        ckpts = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
    assert [(c.step, c.path, c.metrics) for c in ckpts] == [
        (2, str((jd / "checkpoints/checkpoint-2").resolve()), {"loss": 2.0})]


def test_uncommitted_batch_is_read_again_not_lost(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    _write(jd / "events.jsonl", LINES[:2])
    try:
        with session_scope() as s:
            assert ingest_events(s, job_id, jd) == 2
            raise RuntimeError("worker died before the commit")
    except RuntimeError:
        pass
    assert events_of(job_id) == [] and get_job(job_id).events_offset == 0

    assert _ingest(job_id, jd) == 2
    assert len(events_of(job_id)) == 2


def test_checkpoint_event_seen_twice_is_one_row(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    ckpt = LINES[3]
    _write(jd / "events.jsonl", [ckpt, {**ckpt, "metrics": {"loss": 1.5}}])

    _ingest(job_id, jd)

    with session_scope() as s:
        rows = list(s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)))
    assert [(r.step, r.metrics) for r in rows] == [(2, {"loss": 1.5})]


def test_concurrent_ingesters_insert_each_line_once(pg_wenv: WorkerEnv) -> None:
    job_id, jd = _job(pg_wenv)
    _write(jd / "events.jsonl", LINES * 20)
    barrier = threading.Barrier(4)
    counts: list[int] = []

    def ingest_all() -> None:
        barrier.wait()
        n = 0
        for _ in range(20):
            n += _ingest(job_id, jd, max_events=7)
        counts.append(n)

    threads = [threading.Thread(target=ingest_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sum(counts) == len(LINES) * 20
    assert len(events_of(job_id)) == len(LINES) * 20


def test_worker_that_lost_the_job_writes_nothing(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    _write(jd / "events.jsonl", LINES[:2])

    assert _ingest(job_id, jd, worker_id="someone-else", attempt=1) == 0
    with session_scope() as s:
        assert not heartbeat(s, job_id, worker_id="w1", attempt=2)
        assert heartbeat(s, job_id, worker_id="w1", attempt=1)
        assert not read_control(s, job_id, worker_id="w2", attempt=1).held
    assert events_of(job_id) == []
    with session_scope() as s:
        assert s.scalar(select(Job.events_offset).where(Job.id == job_id)) == 0


def test_tracking_events_fold_into_the_job_row(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    first = {"tensorboard": {"logdir": "tensorboard"}, "mlflow": {"run_id": "r1"}}
    _write(jd / "events.jsonl", [{"time": 1.0, "type": "tracking", **first}])
    assert _ingest(job_id, jd) == 1
    assert get_job(job_id).tracking == first
    # A retried attempt reports its runs again (the same MLflow run; W&B added here).
    _write(jd / "events.jsonl", [{"time": 2.0, "type": "tracking", "mlflow": {"run_id": "r1"},
                                  "wandb": {"run_id": "job-1"}}])
    assert _ingest(job_id, jd) == 1
    assert get_job(job_id).tracking == {**first, "wandb": {"run_id": "job-1"}}
    ev = events_of(job_id, "tracking")[0]
    assert ev.message == "tracking runs: tensorboard, mlflow"


def test_preference_rewards_become_the_jobs_preference_metrics(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    rewards = {"reward_chosen": 0.2, "reward_rejected": -0.1, "reward_margin": 0.3,
               "reward_accuracy": 0.75}
    _write(jd / "events.jsonl", [
        *LINES[:2],
        {"time": 1_700_000_002.0, "type": "progress", "step": 2, "loss": 0.6, **rewards},
    ])
    _ingest(job_id, jd)
    assert get_job(job_id).preference_metrics == rewards
    # A supervised job's progress carries none: the column stays empty.
    other_id, other_jd = _job(wenv)
    _write(other_jd / "events.jsonl", LINES)
    _ingest(other_id, other_jd)
    assert get_job(other_id).preference_metrics is None


def test_phase_events_fold_into_the_jobs_phase_until_training_starts(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    loading = {"phase": "loading_model", "message": "loading model: 3 of 21 tensors",
               "attempt": 1, "loaded": 3, "total": 21, "shards": 1}
    _write(jd / "events.jsonl", [
        {"time": 1.0, "type": "phase", "phase": "preparing_data", "message": "preparing data",
         "attempt": 1},
        {"time": 2.0, "type": "phase", **loading},
    ])
    assert _ingest(job_id, jd) == 2
    assert get_job(job_id).phase == {"time": 2.0, **loading}
    assert [e.message for e in events_of(job_id, "phase")] == ["preparing data",
                                                               "loading model: 3 of 21 tensors"]
    _write(jd / "events.jsonl", [{"time": 3.0, "type": "started", "world_size": 1,
                                  "attempt": 1, "total_steps": 10}])
    _ingest(job_id, jd)
    assert get_job(job_id).phase == {"phase": "training", "message": "training", "attempt": 1}


def test_started_event_without_world_size_or_device_is_ingested(wenv: WorkerEnv) -> None:
    job_id, jd = _job(wenv)
    _write(jd / "events.jsonl", [{"time": 1.0, "type": "started", "total_steps": 4}])
    assert _ingest(job_id, jd) == 1
    assert get_job(job_id).total_steps == 4
