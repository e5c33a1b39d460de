"""The OpenAI face's fine-tuning jobs: each use case maps OpenAI's request onto the job
commands and read model (api/services/jobs/), then maps the result back
(api/openai/mapping.py). The JobSpec a create runs as is built in api/openai/job_spec.py;
/v1/models is api/openai/model_lookup.py, the results file api/openai/results_file.py."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.openai import job_spec, listing, mapping
from api.openai.model_lookup import get_model, model_name
from api.openai.reinforcement import openai_reinforcement_hyperparameters
from api.openai.schemas import FineTuningJob, JobCheckpoint, JobCreate, JobEvent, ListOf
from api.services import jobs, placement
from api.services.pagination import could_be_id
from core.db.models import Checkpoint, File, Job, Tenant, utcnow
from core.infra.errors import InvalidRequest, NotFound
from core.infra.settings import Settings
from core.policy.placement import Placement
from core.spec import SpecError, parse_job_spec
from core.spec.catalog import CatalogModel

log = logging.getLogger("ftune.api")
Enqueue = Callable[[str], None]


def _bad(message: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _parse(body: Any) -> JobCreate:
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", None)
    if nul := jobs.nul_problems(body):
        raise _bad(f"{nul[0].param}: {nul[0].message}", nul[0].param)
    try:
        return JobCreate.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if not isinstance(p, int)) or None
        message = first.get("msg", "invalid")
        if first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        raise _bad(f"{param}: {message}" if param else str(message), param) from None


# --------------------------------------------------------------------------- create


def create_job(session: Session, tenant: Tenant, body: Any, *, settings: Settings,
               enqueue: Enqueue | None) -> FineTuningJob:
    req = _parse(body)
    base, entry, continued = _base_model(session, tenant, req.model, settings)
    method_type, asked = job_spec.method_and_hyperparameters(req, entry)
    train = _tenant_file(session, tenant, req.training_file, "training_file")
    if req.validation_file is not None:
        _tenant_file(session, tenant, req.validation_file, "validation_file")
    placement = _placement(session, entry, settings)
    # OpenAI generates a seed when none is given; so do we, and echo it.
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    notes: list[str] = []
    if method_type == "reinforcement":
        spec, notes = job_spec.reinforcement_spec(req, entry, asked, seed, train, placement,
                                                  settings)
        resolved = openai_reinforcement_hyperparameters(spec, entry.learning_rate)
    else:
        resolved = job_spec.resolved_hyperparameters(method_type, asked, train.rows, entry)
        spec = job_spec.supervised_spec(req, entry, method_type, resolved, seed, train, placement)
    if req.evaluation is not None:
        spec["evaluation"] = req.evaluation
    if continued is not None:
        # The source's adapter (and with it its base, task and peft: from_job fills them).
        spec["model"] = continued
        spec.pop("peft", None)
    try:
        job, _ = jobs.submit_job(session, tenant, spec, settings=settings, enqueue=enqueue)
    except SpecError as e:
        raise job_spec.spec_error_in_request_terms(e, method_type) from None
    job.openai = {
        "model": req.model,
        "base": base,
        "method_type": method_type,
        "hyperparameters": resolved,
        "hyperparameters_asked": asked,
        "training_file": req.training_file,
        "validation_file": req.validation_file,
        "suffix": req.suffix,
        "seed": seed,
        "metadata": req.metadata,
        "integrations": [i.model_dump() for i in req.integrations or []],
        "placement": {"strategy": placement.strategy, "num_processes": placement.num_processes,
                      "reason": placement.reason},
        "notes": notes,
    }
    listing.record_metadata(session, job, req.metadata)
    session.flush()
    return to_openai(session, tenant, job, settings)


def _base_model(session: Session, tenant: Tenant, model: str, settings: Settings
                ) -> tuple[str, CatalogModel, dict[str, Any] | None]:
    """(the catalog id, its entry, and for an ``ft:`` model the spec's model section that
    continues from that job: model.from_job, at its checkpoint's step for a
    ``...:ckpt-step-N`` name). Only the tenant's own succeeded jobs' names are found;
    another tenant's reads as one that does not exist."""
    if not model.startswith("ft:"):
        return model, _catalog_model(model, settings), None
    try:
        get_model(session, tenant, settings, model)
    except NotFound:
        raise _bad(f"model {model!r}: no fine-tuned model of yours has this name "
                   "(GET /v1/models lists them)", "model") from None
    ft = mapping.parse_ft_name(model)
    assert ft is not None
    job = find_job(session, tenant, ft.job_id)
    spec = job.spec or {}
    base = (job.openai or {}).get("base") or mapping.base_model_id(spec, job.openai,
                                                                   settings.model_catalog)
    source = spec.get("model") or {}
    entry = settings.model_catalog.get(base) or CatalogModel(
        location=str(source.get("name_or_path") or "model"), task=source.get("task", "causal_lm"),
        max_seq_length=int((spec.get("dataset") or {}).get("max_seq_length", 1024)))
    entry = entry.model_copy(update={"location": source.get("name_or_path", entry.location),
                                     "peft": None})
    return base, entry, {"from_job": job.id, **({"step": ft.step} if ft.step else {})}


def _catalog_model(model: str, settings: Settings) -> CatalogModel:
    entry = settings.model_catalog.get(model)
    if entry is None:
        known = ", ".join(sorted(settings.model_catalog)) or "none configured"
        raise _bad(f"model {model!r} is not in this server's catalog (available: {known})",
                   "model")
    return entry


def _tenant_file(session: Session, tenant: Tenant, file_id: str, param: str) -> File:
    f = None
    if could_be_id(file_id):
        f = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if f is None:
        raise _bad(f"{param}: no file {file_id!r} (upload it with purpose 'fine-tune')", param)
    return f


def _placement(session: Session, entry: CatalogModel, settings: Settings) -> Placement:
    try:
        spec = parse_job_spec({"model": {"name_or_path": entry.location, "task": entry.task},
                               "dataset": {"path": "/", "max_seq_length": entry.max_seq_length},
                               **({"peft": entry.peft} if entry.peft else {})})
    except SpecError:  # the catalog entry's own problem: the submit names it
        return Placement("none", 1, "the catalog entry does not make a valid spec")
    return placement.place(session, settings, spec, entry.gpus)


# --------------------------------------------------------------------------- read


def to_openai(session: Session, tenant: Tenant, job: Job, settings: Settings) -> FineTuningJob:
    return _many(session, tenant, [job], settings)[0]


def _many(session: Session, tenant: Tenant, rows: list[Job],
          settings: Settings) -> list[FineTuningJob]:
    objects = jobs.job_objects(session, rows, settings)
    now = utcnow()
    return [mapping.job_to_openai(o, r.openai, tenant.id, tenant.name, settings.model_catalog,
                                  now) for o, r in zip(objects, rows, strict=True)]


def find_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    job = jobs.find_tenant_job(session, tenant.id, job_id) if could_be_id(job_id) else None
    if job is None:
        raise NotFound(f"no fine-tuning job {job_id!r}", param="fine_tuning_job_id")
    return job


def list_jobs(session: Session, tenant: Tenant, settings: Settings, limit: int,
              after: str | None, metadata: dict[str, str]) -> ListOf[FineTuningJob]:
    """Newest first. A metadata filter keeps the jobs whose metadata has every pair."""
    page, more = listing.page_jobs(session, tenant.id, limit, after, metadata)
    return ListOf[FineTuningJob](data=_many(session, tenant, page, settings), has_more=more)


def list_events(session: Session, job: Job, limit: int, after: str | None) -> ListOf[JobEvent]:
    """Newest first, as OpenAI lists them; ``after`` is an event id: older ones follow."""
    n = None
    if after is not None:
        n = mapping.event_id(after)
        if n is None:
            raise _bad(f"after: {after!r} is not an event id of this job", "after")
    rows = jobs.event_page(session, job.id, limit + 1, before=n, newest_first=True)
    return ListOf[JobEvent](data=[mapping.event_to_openai(e) for e in rows[:limit]],
                            has_more=len(rows) > limit)


def list_checkpoints(session: Session, tenant: Tenant, job: Job, settings: Settings,
                     limit: int, after: str | None) -> ListOf[JobCheckpoint]:
    """Newest first; each has the ``ft:`` name of its own model (the job's, with its step)."""
    q = select(Checkpoint).where(Checkpoint.job_id == job.id)
    if after is not None:
        n = mapping.checkpoint_id(after)
        if n is None:
            raise _bad(f"after: {after!r} is not a checkpoint id of this job", "after")
        q = q.where(Checkpoint.id < n)
    rows = list(session.scalars(q.order_by(Checkpoint.id.desc()).limit(limit + 1)))
    name = model_name(tenant, job, settings)
    return ListOf[JobCheckpoint](
        data=[mapping.checkpoint_to_openai(c, job.id, name) for c in rows[:limit]],
        has_more=len(rows) > limit)


# --------------------------------------------------------------------------- commands


def cancel(session: Session, tenant: Tenant, job: Job, settings: Settings) -> FineTuningJob:
    return to_openai(session, tenant, jobs.cancel_job(session, job), settings)


def pause(session: Session, tenant: Tenant, job: Job, settings: Settings) -> FineTuningJob:
    return to_openai(session, tenant, jobs.pause_job(session, job), settings)


def resume(session: Session, tenant: Tenant, job: Job, settings: Settings,
           enqueue: Enqueue | None) -> FineTuningJob:
    return to_openai(session, tenant, jobs.resume_job(session, job, enqueue), settings)
