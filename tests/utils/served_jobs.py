"""A succeeded job as the serving path reads it (core/serving/resolve.py): a row with a job
directory holding its adapter and the kept checkpoints' folders. No weights: the names
resolve, nothing is loaded."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from core.db.models import Checkpoint, Job, JobStatus, utcnow

ADAPTER_CONFIG = "adapter_config.json"


def served_job(session: Session, tenant_id: str, job_dir: Path, *, name: str = "x",
               base: str = "tiny", steps: tuple[int, ...] = ()) -> Job:
    """Added and flushed (the caller commits)."""
    for folder in ("adapter", *(f"checkpoint-{s}" for s in steps)):
        (job_dir / folder).mkdir(parents=True, exist_ok=True)
        (job_dir / folder / ADAPTER_CONFIG).write_text("{}")
    job = Job(tenant_id=tenant_id, status=JobStatus.succeeded, name=name,
              spec={"model": {"name_or_path": base}}, job_dir=str(job_dir),
              adapter_path="adapter", finished_at=utcnow())
    session.add(job)
    session.flush()
    session.add_all(Checkpoint(job_id=job.id, step=s, path=f"checkpoint-{s}") for s in steps)
    session.flush()
    return job
