"""The results file of a succeeded OpenAI job (``file-results-...``, OpenAI's
step_metrics.csv): found by its id, its object and its content built from the job's events."""

from __future__ import annotations

import hashlib

from sqlalchemy.orm import Session

from api.openai import mapping
from api.schemas import FileObject
from api.services import jobs
from api.services.pagination import could_be_id
from core.db.models import Job, JobStatus, Tenant

MAX_RESULT_EVENTS = 100_000


def results_job(session: Session, tenant: Tenant, file_id: str) -> Job | None:
    """The succeeded job whose results file ``file_id`` is, or None if it names none."""
    job_id = mapping.job_of_results_file(file_id)
    if job_id is None or not could_be_id(job_id):
        return None
    job = jobs.find_tenant_job(session, tenant.id, job_id)
    return job if job is not None and job.status == JobStatus.succeeded else None


def results_content(session: Session, job: Job) -> bytes:
    return mapping.results_csv(jobs.events_after(session, job.id, None, MAX_RESULT_EVENTS))


def results_file_object(session: Session, job: Job) -> FileObject:
    content = results_content(session, job)
    return FileObject(
        id=mapping.results_file_id(job.id), filename="step_metrics.csv", format="csv",
        bytes=len(content), rows=max(0, content.count(b"\n") - 1),
        columns=list(mapping.RESULTS_COLUMNS), sha256=hashlib.sha256(content).hexdigest(),
        created_at=mapping.unix(job.finished_at or job.created_at) or 0,
        purpose="fine-tune-results")
