"""GET /v1/fine_tuning/jobs: a page costs its rows, whatever the history.

Without a filter, the tenant's jobs newest first by keyset on ix_jobs_tenant_created. With
``metadata[key]=value`` filters, the rows of job_metadata for the first pair, read in list
order from ix_job_metadata_lookup (which holds each job's created_at), the other pairs
checked per row: a filter that matches few jobs reads those few, not every job of the tenant.
The pairs are written with the job (``record_metadata``); jobs.openai keeps them as sent.
"""

from __future__ import annotations

from sqlalchemy import exists, false, select
from sqlalchemy.orm import Session, aliased

from api.services.pagination import page_after
from core.db.models import Job, JobMetadata

# What api/openai/schemas.py lets a job's metadata hold: a filter outside it matches nothing.
MAX_KEY, MAX_VALUE = 64, 512


def record_metadata(session: Session, job: Job, metadata: dict[str, str] | None) -> None:
    session.add_all(JobMetadata(job_id=job.id, key=k, tenant_id=job.tenant_id, value=v,
                                created_at=job.created_at)
                    for k, v in (metadata or {}).items())


def _storable(key: str, value: str) -> bool:
    return (1 <= len(key) <= MAX_KEY and len(value) <= MAX_VALUE
            and "\x00" not in key and "\x00" not in value)  # PostgreSQL refuses NUL in text


def page_jobs(session: Session, tenant_id: str, limit: int, after: str | None,
              metadata: dict[str, str]) -> tuple[list[Job], bool]:
    """Newest first: up to ``limit`` of the tenant's jobs after job ``after`` whose metadata
    has every pair of ``metadata``, and whether more follow."""
    query = select(Job).where(Job.tenant_id == tenant_id)
    if not metadata:
        return page_after(session, query, Job, tenant_id, limit, after)
    pairs = sorted(metadata.items())
    if not all(_storable(k, v) for k, v in pairs):
        query = query.where(false())  # still checks ``after`` as every list does
        return page_after(session, query, Job, tenant_id, limit, after)
    (key, value), rest = pairs[0], pairs[1:]
    first = aliased(JobMetadata)
    query = query.join(first, first.job_id == Job.id).where(
        first.tenant_id == tenant_id, first.key == key, first.value == value)
    for k, v in rest:
        other = aliased(JobMetadata)
        query = query.where(exists().where(other.job_id == first.job_id, other.key == k,
                                           other.value == v))
    return page_after(session, query, Job, tenant_id, limit, after,
                      keys=(first.created_at, first.job_id))
