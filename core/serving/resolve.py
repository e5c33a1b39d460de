"""A model name -> what serves it, confined to the tenant: a catalog id (a base model), an
``ft:`` name (a succeeded job's adapter or full model), a checkpoint's ``ft:...:ckpt-step-N``
and, on the native side, a job id. Another tenant's names read as names that do not exist."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.models import Checkpoint, Job, JobStatus, Tenant
from core.infra.errors import NotFound
from core.infra.settings import Settings
from core.run.jobdir import MODEL_DIR
from core.serving.engine import SERVED_NAME
from core.serving.names import model_name_of, parse_ft_name

ADAPTER_CONFIG = "adapter_config.json"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or you do not have access to "
                         "it (GET /v1/models lists yours).", param="model")


@dataclass(frozen=True)
class Adapter:
    engine_name: str  # the name it is loaded under in the engine
    path: Path


@dataclass(frozen=True)
class Resolved:
    """What serves ``model``: the deployment (by key: at most one per model served) and,
    for a fine-tuned adapter, the adapter loaded into it."""

    model: str  # as the user wrote it; put back in every object returned
    deployment_key: str
    deployment_kind: str  # base | full
    location: str  # the deployment's --model
    keep_warm: bool = False
    adapter: Adapter | None = None
    job_id: str | None = None

    @property
    def engine_model(self) -> str:
        return self.adapter.engine_name if self.adapter is not None else SERVED_NAME


def base_key(location: str) -> str:
    return "base:" + hashlib.sha256(location.encode()).hexdigest()[:40]


def full_key(location: Path) -> str:
    return "full:" + hashlib.sha256(str(location).encode()).hexdigest()[:40]


def resolve(session: Session, tenant: Tenant, model: str, settings: Settings, *,
            evaluating: str | None = None) -> Resolved:
    """Raises ModelNotFound (404 model_not_found) for a name that is not the tenant's.
    ``evaluating``: a job still running whose evaluation (after training, before it is
    final) asks for its own checkpoints and final model; no other caller may name them."""
    entry = settings.model_catalog.get(model)
    if entry is not None:
        return Resolved(model=model, deployment_key=base_key(entry.location),
                        deployment_kind="base", location=entry.location,
                        keep_warm=entry.keep_warm)
    ft = parse_ft_name(model)
    job_id, step = (ft.job_id, ft.step) if ft is not None else (model, None)
    job = _own_succeeded_job(session, tenant, job_id, evaluating)
    if job is None or (ft is not None and not _names_job(model, job, tenant, settings)):
        raise ModelNotFound(model)
    if not job.job_dir:
        raise ModelNotFound(model)
    root = Path(job.job_dir).resolve()
    if step is None:
        folder = _inside(root, job.adapter_path)
    else:
        path = session.scalar(select(Checkpoint.path).where(
            Checkpoint.job_id == job.id, Checkpoint.step == step))
        folder = _inside(root, path)
        if folder is not None and (folder / MODEL_DIR).is_dir():
            folder = folder / MODEL_DIR  # a full fine-tune's checkpoint
    if folder is None or not folder.is_dir():
        raise ModelNotFound(model)
    if not (folder / ADAPTER_CONFIG).is_file():
        return Resolved(model=model, deployment_key=full_key(folder), deployment_kind="full",
                        location=str(folder), job_id=job.id)
    base = str((job.spec or {}).get("model", {}).get("name_or_path", ""))
    keep_warm = any(e.keep_warm for e in settings.model_catalog.values() if e.location == base)
    name = job.id if step is None else f"{job.id}-ckpt-{step}"
    return Resolved(model=model, deployment_key=base_key(base), deployment_kind="base",
                    location=base, keep_warm=keep_warm, adapter=Adapter(name, folder),
                    job_id=job.id)


def _own_succeeded_job(session: Session, tenant: Tenant, job_id: str,
                       evaluating: str | None = None) -> Job | None:
    if not job_id.startswith("job-") or len(job_id) > 40:
        return None
    job = session.get(Job, job_id)
    usable = job is not None and (job.status == JobStatus.succeeded or (
        job.id == evaluating and job.status == JobStatus.running))
    if job is None or not usable or job.tenant_id != tenant.id \
            or job.model_deleted_at is not None:
        return None
    return job


def _names_job(model: str, job: Job, tenant: Tenant, settings: Settings) -> bool:
    """The whole name must be the job's (or one of its checkpoints'), not just end with
    its id."""
    own = model_name_of(job.id, job.name, job.spec or {}, job.openai, settings.model_catalog,
                        tenant.name)
    return model == own or model.startswith(own + ":ckpt-step-")


def _inside(root: Path, path: str | None) -> Path | None:
    if not path:
        return None
    p = (root / path).resolve()
    return p if p.is_relative_to(root) else None
