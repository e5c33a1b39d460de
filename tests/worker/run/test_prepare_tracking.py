"""The worker resolves a job's trackers from its own settings into spec.json, and refuses a
tracker the operator no longer allows (before any process starts)."""

from __future__ import annotations

import pytest

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from tests.utils.worker import WorkerEnv, fake_job, get_job
from worker.run.local import run_job

SERVER = "http://mlflow.internal:5000"


def test_destinations_come_from_the_worker_settings(
    wenv: WorkerEnv, direct: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FTUNE_TRACKING_ALLOWED", "tensorboard,mlflow")
    monkeypatch.setenv("FTUNE_MLFLOW_TRACKING_URI", SERVER)
    wenv.reload()
    job_id = fake_job(wenv, "succeed", tracking={"report_to": ["mlflow"], "tags": {"a": "b"}})

    assert run_job(job_id) == JobStatus.succeeded

    tracking = JobDir(wenv.settings.jobs_dir / job_id).read_spec()["runtime"]["tracking"]
    tenant = get_job(job_id).tenant_id
    assert tracking["mlflow"] == {"tracking_uri": SERVER, "experiment_name": f"ftune/{tenant}",
                                  "artifact_location": None, "ui_url": SERVER}
    assert tracking["tags"] == {"a": "b", "ftune.job_id": job_id, "ftune.tenant_id": tenant}


def test_a_tracker_no_longer_allowed_is_refused_before_launch(
    wenv: WorkerEnv, direct: None
) -> None:
    job_id = fake_job(wenv, "succeed", tracking={"report_to": ["wandb"]})

    assert run_job(job_id) == JobStatus.failed

    job = get_job(job_id)
    assert job.error_code == "invalid_spec"
    assert "tracking.report_to" in (job.error_message or "")
    assert "wandb not enabled" in (job.error_message or "")
    assert not (wenv.settings.jobs_dir / job_id / "trainer.log").exists()
