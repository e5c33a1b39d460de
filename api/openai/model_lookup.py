"""The models OpenAI's /v1/models lists and retrieves: the catalog's base models and the
tenant's fine-tuned ones, each by its ``ft:`` name (a checkpoint's with its step); another
tenant's, or a deleted one, reads as a model that does not exist."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.openai import mapping
from api.openai.schemas import ListOf, ModelOut
from api.services import jobs
from api.services.pagination import could_be_id
from core.db.models import Checkpoint, Job, JobStatus, Tenant
from core.infra.errors import NotFound
from core.infra.settings import Settings
from core.spec.catalog import CatalogModel


def list_models(session: Session, tenant: Tenant, settings: Settings) -> ListOf[ModelOut]:
    """The catalog's base models, then the tenant's fine-tuned models (newest first)."""
    out = [_catalog_out(k, v) for k, v in sorted(settings.model_catalog.items())]
    done = session.scalars(select(Job).where(Job.tenant_id == tenant.id,
                                             Job.status == JobStatus.succeeded,
                                             Job.model_deleted_at.is_(None))
                           .order_by(Job.finished_at.desc()).limit(1000))
    out.extend(_fine_tuned_out(tenant, j, settings) for j in done)
    return ListOf[ModelOut](data=out)


def get_model(session: Session, tenant: Tenant, settings: Settings, model: str) -> ModelOut:
    if model in settings.model_catalog:
        return _catalog_out(model, settings.model_catalog[model])
    ft = mapping.parse_ft_name(model)
    if ft is not None and could_be_id(ft.job_id):
        job = jobs.find_tenant_job(session, tenant.id, ft.job_id)
        if job is not None and job.status == JobStatus.succeeded \
                and job.model_deleted_at is None:
            own = _fine_tuned_out(tenant, job, settings)
            if ft.step is None and own.id == model:
                return own
            if ft.step is not None and session.scalar(select(Checkpoint.id).where(
                    Checkpoint.job_id == job.id, Checkpoint.step == ft.step)) is not None:
                return own.model_copy(update={"id": model})
    raise NotFound(f"no model {model!r}", param="model")


def _catalog_out(model_id: str, entry: CatalogModel) -> ModelOut:
    return ModelOut(id=model_id, created=entry.created, owned_by=entry.owned_by,
                    ftune_location=entry.location)


def _fine_tuned_out(tenant: Tenant, job: Job, settings: Settings) -> ModelOut:
    return ModelOut(id=model_name(tenant, job, settings),
                    created=mapping.unix(job.finished_at or job.created_at) or 0,
                    owned_by=tenant.id, ftune_job_id=job.id)


def model_name(tenant: Tenant, job: Job, settings: Settings) -> str:
    """The job's ``ft:`` name (what fine_tuned_model says once it succeeded)."""
    return mapping.model_name_of(job.id, job.name, job.spec or {}, job.openai,
                                 settings.model_catalog, tenant.name)
