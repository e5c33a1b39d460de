"""The worker's world for tests: settings pointed at a temp data dir and a chosen database
(``configure_worker``), and factories for tenants, files and jobs, which the teardown
(``teardown_worker``) leaves no job of queued or running. The fixtures that use them are in
tests/worker/conftest.py."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core.db.models import File, Job, JobEvent, JobStatus, Tenant, utcnow
from core.db.session import reset_engine_cache, session_scope
from core.infra.settings import Settings, get_settings, reset_settings_cache
from testkit.launch import REPO_ROOT
from tests.utils.specs import spec_body
from tests.utils.tiny import text_rows, write_jsonl

FAKE_TRAINER = "testkit.fake_trainer"


@dataclass
class WorkerEnv:
    settings: Settings
    tmp: Path
    data_root: Path
    model_root: Path
    env: dict[str, str]  # what a worker subprocess needs to see the same world

    def reload(self) -> Settings:
        reset_settings_cache()
        reset_engine_cache()
        self.settings = get_settings()
        return self.settings


def configure_worker(monkeypatch: pytest.MonkeyPatch, tmp: Path, db_url: str,
               **overrides: str) -> WorkerEnv:
    from core.jobs.dispatch import reset_producers

    data_root = tmp / "datasets"
    model_root = tmp / "models"
    data_root.mkdir(parents=True, exist_ok=True)
    model_root.mkdir(parents=True, exist_ok=True)
    env = {
        "FTUNE_DATA_DIR": str(tmp / "data"),
        "DATABASE_URL": db_url,
        "BROKER_URL": "filesystem://",
        "FTUNE_ALLOWED_DATA_ROOTS": str(data_root),
        "FTUNE_ALLOWED_MODEL_ROOTS": str(model_root),
        "FTUNE_WORKER_GPUS": "0",
        "FTUNE_WORKER_ID": f"test-worker-{secrets.token_hex(3)}",
        "FTUNE_HEARTBEAT_SECONDS": "0.5",
        "FTUNE_CANCEL_GRACE_SECONDS": "5",
        "FTUNE_TRAINER_MODULE": FAKE_TRAINER,
        **overrides,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    reset_settings_cache()
    reset_engine_cache()
    reset_producers()
    return WorkerEnv(get_settings(), tmp, data_root, model_root, env)


_created: list[str] = []


def finish_leftovers() -> None:
    """Other tests (and the e2e stack's reconciler) share the PostgreSQL database: leave no
    job of ours queued or running for them to pick up."""
    from sqlalchemy import update

    if not _created:
        return
    with session_scope() as s:
        s.execute(update(Job).where(Job.id.in_(_created),
                                    Job.status.in_(["queued", "running", "cancelling"]))
                  .values(status="cancelled", finished_at=utcnow()))
    _created.clear()


def teardown_worker() -> None:
    from core.jobs.dispatch import reset_producers

    finish_leftovers()
    reset_producers()
    reset_settings_cache()
    reset_engine_cache()


# ---------------------------------------------------------------------------------- factories


def make_tenant() -> str:
    with session_scope() as s:
        t = Tenant(name=f"tenant-{secrets.token_hex(4)}")
        s.add(t)
        s.flush()
        return t.id


def make_file(tenant_id: str, path: Path) -> str:
    import hashlib

    with session_scope() as s:
        f = File(tenant_id=tenant_id, filename=path.name, format="jsonl", bytes=path.stat().st_size,
                 rows=64, columns=["text"], sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                 storage_path=str(path))
        s.add(f)
        s.flush()
        return f.id


def job_spec(model: str | Path, *, name: str = "fake:succeed", file_id: str | None = None,
             path: Path | None = None, **sections: dict[str, Any]) -> dict[str, Any]:
    dataset: dict[str, Any] = {"format": "text", "max_seq_length": 32}
    if file_id is not None:
        dataset["file_id"] = file_id
    else:
        dataset["path"] = str(path)
    return {"name": name, **spec_body(model, dataset=dataset, **sections)}


def make_job(spec: dict[str, Any], *, tenant_id: str | None = None,
             status: str = JobStatus.queued, **values: Any) -> str:
    tenant_id = tenant_id or make_tenant()
    now = utcnow()
    with session_scope() as s:
        job = Job(tenant_id=tenant_id, name=spec.get("name"), status=status, spec=spec,
                  created_at=now, queued_at=now, **values)
        s.add(job)
        s.flush()
        _created.append(job.id)
        return job.id


def fake_job(w: WorkerEnv, mode: str = "succeed", **sections: dict[str, Any]) -> str:
    """A queued job for the fake trainer, on an uploaded file of the job's tenant."""
    tenant = make_tenant()
    data = write_jsonl(w.data_root / f"train-{secrets.token_hex(3)}.jsonl", text_rows(8))
    file_id = make_file(tenant, data)
    model = w.model_root / "fake-model"
    model.mkdir(exist_ok=True)
    return make_job(job_spec(model, name=f"fake:{mode}", file_id=file_id, **sections),
                    tenant_id=tenant)


def get_job(job_id: str) -> Job:
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        s.expunge(job)
        return job


def events_of(job_id: str, type_: str | None = None) -> list[JobEvent]:
    with session_scope() as s:
        q = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        if type_ is not None:
            q = q.where(JobEvent.type == type_)
        rows = list(s.scalars(q))
        for r in rows:
            s.expunge(r)
        return rows


def statuses(job_id: str) -> list[str]:
    return [e.data["status"] for e in events_of(job_id, "status")]


def set_job(job_id: str, **values: Any) -> None:
    from sqlalchemy import update

    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))


def request_cancel(job_id: str) -> None:
    """What the API does for a cancel: the state machine's move (running -> cancelling)."""
    from core.jobs import state as jobstate

    with session_scope() as s:
        assert jobstate.request_cancel(s, job_id, previous=get_job(job_id).status, now=utcnow())


def ago(seconds: float) -> datetime:
    from datetime import timedelta

    return utcnow() - timedelta(seconds=seconds)


def subprocess_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    return env
