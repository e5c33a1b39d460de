"""Retention (worker/upkeep/retention.py): old finished jobs lose their events, logs and
artifacts, in bounded batches; nothing of a queued, running, paused or recent job is
touched; each pass reads only the jobs finished since the previous one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert, select

from core.db.models import Checkpoint, Job, JobEvent, JobStatus, utcnow
from core.db.session import get_sessionmaker, session_scope
from core.infra.settings import Settings
from tests.utils.worker import WorkerEnv, get_job, job_spec, make_job
from worker.upkeep.retention import apply_retention

DAYS = 30
KEPT_FILES = ("spec.json", "launch.json", "error.json")
PRUNED_FILES = ("events.jsonl", "trainer.log", "checkpoints/checkpoint-2/adapter_model.bin",
                "adapter/adapter_model.safetensors")


@pytest.fixture(params=["sqlite", "postgres"])
def renv(request: pytest.FixtureRequest, tmp_path: Path,
         configure: Callable[..., WorkerEnv]) -> Iterator[WorkerEnv]:
    """A database of its own (retention reads every job, and keeps its marks there)."""
    if request.param == "sqlite":
        url = request.getfixturevalue("sqlite_url")
        yield configure(tmp_path, url)
        return
    from core.db.session import reset_engine_cache
    from testkit.pg import migrated_database
    from tests.utils.worker import finish_leftovers

    with migrated_database("ftune_retention") as url:
        yield configure(tmp_path, url)
        finish_leftovers()  # while the database is there (configure's teardown runs after)
        reset_engine_cache()


def settings_of(w: WorkerEnv, **days: float | None) -> Settings:
    every = {f"retention_{k}_days": DAYS for k in ("events", "logs", "artifacts")}
    every.update({f"retention_{k}_days": v for k, v in days.items()})
    return w.settings.model_copy(update={**every, "retention_batch_rows": 100})


def history_job(w: WorkerEnv, status: str, finished_days_ago: float | None,
                events: int = 250, **values: Any) -> str:
    """A job with ``events`` events, a checkpoint row and every file a run leaves."""
    job_id = make_job(job_spec(w.model_root, path=w.data_root / "x.jsonl"), status=status,
                      **values)
    root = w.settings.jobs_dir / job_id
    for name in (*KEPT_FILES, *PRUNED_FILES):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    now = utcnow()
    finished = now - timedelta(days=finished_days_ago) if finished_days_ago is not None else None
    with session_scope() as s:
        s.execute(Job.__table__.update().where(Job.id == job_id).values(
            job_dir=str(root), finished_at=finished, train_loss=0.5, step=20,
            adapter_path=str(root / "adapter") if status == JobStatus.succeeded else None))
        s.execute(insert(JobEvent), [{"job_id": job_id, "type": "progress", "message": str(k),
                                      "data": {"step": k}, "created_at": now}
                                     for k in range(events)])
        s.add(Checkpoint(job_id=job_id, step=2, path=str(root / "checkpoints/checkpoint-2"),
                         metrics={"loss": 0.5}))
    return job_id


def event_count(job_id: str) -> int:
    with session_scope() as s:
        return s.scalar(select(func.count(JobEvent.id)).where(JobEvent.job_id == job_id)) or 0


def files_of(w: WorkerEnv, job_id: str) -> set[str]:
    root = w.settings.jobs_dir / job_id
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_an_old_finished_job_keeps_its_row_metrics_and_usage_but_not_its_history(
    renv: WorkerEnv,
) -> None:
    old = history_job(renv, JobStatus.succeeded, finished_days_ago=DAYS + 5)
    done = apply_retention(get_sessionmaker(), settings_of(renv))
    assert done == {"events": 1, "logs": 1, "artifacts": 1}
    assert event_count(old) == 0  # 250 events, 100 per transaction
    assert files_of(renv, old) == set(KEPT_FILES)
    job = get_job(old)
    assert (job.status, job.step, job.train_loss, job.adapter_path) == ("succeeded", 20, 0.5, None)
    with session_scope() as s:
        (metrics,) = s.scalars(select(Checkpoint.metrics).where(Checkpoint.job_id == old))
    assert metrics == {"loss": 0.5}


def test_nothing_of_a_queued_running_paused_or_recent_job_is_touched(renv: WorkerEnv) -> None:
    long_ago = utcnow() - timedelta(days=3 * DAYS)
    kept = [
        history_job(renv, JobStatus.queued, None),
        history_job(renv, JobStatus.running, None, started_at=long_ago),
        history_job(renv, JobStatus.paused, None, started_at=long_ago),
        history_job(renv, JobStatus.cancelling, None, started_at=long_ago),
        history_job(renv, JobStatus.failed, finished_days_ago=DAYS - 1),
    ]
    apply_retention(get_sessionmaker(), settings_of(renv))
    for job_id in kept:
        assert event_count(job_id) == 250
        assert files_of(renv, job_id) == {*KEPT_FILES, *PRUNED_FILES}


def test_each_kind_has_its_own_age(wenv: WorkerEnv) -> None:
    job_id = history_job(wenv, JobStatus.failed, finished_days_ago=10)
    done = apply_retention(get_sessionmaker(),
                           settings_of(wenv, events=5, logs=None, artifacts=20))
    assert done == {"events": 1, "artifacts": 0}
    assert event_count(job_id) == 0
    assert files_of(wenv, job_id) == {*KEPT_FILES, *PRUNED_FILES} - {"events.jsonl"}


def test_a_pass_reads_only_the_jobs_finished_since_the_previous_one(wenv: WorkerEnv) -> None:
    settings = settings_of(wenv, logs=None, artifacts=None)
    first = history_job(wenv, JobStatus.succeeded, finished_days_ago=DAYS + 2)
    assert apply_retention(get_sessionmaker(), settings) == {"events": 1}
    second = history_job(wenv, JobStatus.cancelled, finished_days_ago=DAYS + 1)
    assert apply_retention(get_sessionmaker(), settings) == {"events": 1}  # not the first again
    assert event_count(first) == event_count(second) == 0


def test_the_artifacts_an_unfinished_job_continues_from_are_kept(wenv: WorkerEnv) -> None:
    source = history_job(wenv, JobStatus.succeeded, finished_days_ago=DAYS + 5)
    spec = job_spec(wenv.model_root, path=wenv.data_root / "x.jsonl")
    spec["model"]["from_job"] = source
    make_job(spec, status=JobStatus.running)
    apply_retention(get_sessionmaker(), settings_of(wenv, events=None, logs=None))
    assert files_of(wenv, source) >= {"adapter/adapter_model.safetensors",
                                      "checkpoints/checkpoint-2/adapter_model.bin"}
    assert get_job(source).adapter_path is not None


def test_ftune_retention_applies_the_settings_once(wenv: WorkerEnv,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from cli.main import app
    from core.infra.settings import reset_settings_cache

    old = history_job(wenv, JobStatus.succeeded, finished_days_ago=DAYS + 1)
    assert "no retention is set" in CliRunner().invoke(app, ["retention"]).output
    monkeypatch.setenv("FTUNE_RETENTION_EVENTS_DAYS", str(DAYS))
    reset_settings_cache()
    result = CliRunner().invoke(app, ["retention"])
    assert result.exit_code == 0, result.output
    assert "events: 1 finished job(s) read" in result.output
    assert event_count(old) == 0 and "trainer.log" in files_of(wenv, old)
