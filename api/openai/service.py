"""The OpenAI face's use cases: each maps OpenAI's request onto the job commands and read
model (api/services/jobs/), then maps the result back (api/openai/mapping.py)."""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.openai import hyperparameters as hp
from api.openai import listing, mapping
from api.openai.reinforcement import (
    openai_reinforcement_fields,
    openai_reinforcement_hyperparameters,
)
from api.openai.schemas import (
    FineTuningJob,
    JobCheckpoint,
    JobCreate,
    JobEvent,
    ListOf,
    ModelOut,
)
from api.schemas import FileObject
from api.services import jobs, placement
from api.services.graders import checked_grader
from api.services.pagination import could_be_id
from core.db.models import Checkpoint, File, Job, JobStatus, Tenant, utcnow
from core.infra.errors import InvalidRequest, NotFound
from core.infra.settings import Settings
from core.policy.placement import Placement
from core.spec import SpecError, parse_job_spec
from core.spec.catalog import CatalogModel
from core.spec.grpo import GrpoSpec

log = logging.getLogger("ftune.api")
Enqueue = Callable[[str], None]
MAX_RESULT_EVENTS = 100_000

# Where a problem with our spec's field lies in OpenAI's request (longest prefix first).
# The grader's own paths carry over, below method.reinforcement.grader.
GRADER_PARAM = "method.reinforcement.grader"
SPEC_PARAMS: tuple[tuple[str, str], ...] = (
    ("training.grpo.grader", GRADER_PARAM),
    ("dataset.eval_file_id", "validation_file"),
    ("dataset", "training_file"),
    ("model", "model"),
    ("training", "hyperparameters"),
    ("tracking", "integrations"),
    ("distributed", "model"),
    ("peft", "model"),
)


def _openai_param(param: str, method_type: str = "supervised") -> str | None:
    if param == "training.grpo.grader" or param.startswith("training.grpo.grader."):
        return GRADER_PARAM + param.removeprefix("training.grpo.grader")
    if param == "evaluation" or param.startswith("evaluation."):
        return param  # the extension field is the spec's section, as sent
    for prefix, theirs in SPEC_PARAMS:
        if param == prefix or param.startswith(prefix + "."):
            if theirs == "hyperparameters" and method_type != "supervised":
                return f"method.{method_type}.hyperparameters"
            return theirs
    return None


def _bad(message: str, param: str | None) -> InvalidRequest:
    return InvalidRequest(message, param=param)


def _from_spec_error(exc: SpecError, method_type: str) -> InvalidRequest:
    """Our spec's problems in the terms of the request the user sent: the first problem's
    param mapped to OpenAI's (training_file, model, ...), every problem in details."""
    first = exc.problems[0]
    details = [{"param": _openai_param(p.param, method_type) or p.param,
                "message": f"{p.param}: {p.message}"} for p in exc.problems]
    more = f" (and {len(details) - 1} more: see details)" if len(details) > 1 else ""
    return InvalidRequest(f"{first.param}: {first.message}{more}",
                          param=_openai_param(first.param, method_type), details=details)


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
    method_type, asked = _method(req, entry)
    train = _tenant_file(session, tenant, req.training_file, "training_file")
    if req.validation_file is not None:
        _tenant_file(session, tenant, req.validation_file, "validation_file")
    placement = _placement(session, entry, settings)
    # OpenAI generates a seed when none is given; so do we, and echo it.
    seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
    notes: list[str] = []
    if method_type == "reinforcement":
        spec, notes = _reinforcement_spec(req, entry, asked, seed, train, placement, settings)
        resolved = openai_reinforcement_hyperparameters(spec, entry.learning_rate)
    else:
        resolved = _resolve(method_type, asked, train.rows, entry)
        spec = _spec(req, entry, method_type, resolved, seed, train, placement)
    if req.evaluation is not None:
        spec["evaluation"] = req.evaluation
    if continued is not None:
        # The source's adapter (and with it its base, task and peft: from_job fills them).
        spec["model"] = continued
        spec.pop("peft", None)
    try:
        job, _ = jobs.submit_job(session, tenant, spec, settings=settings, enqueue=enqueue)
    except SpecError as e:
        raise _from_spec_error(e, method_type) from None
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


def _method(req: JobCreate, entry: CatalogModel) -> tuple[str, dict[str, Any]]:
    """(method type, the hyperparameters as asked, unset ones left out)."""
    if req.method is not None and req.hyperparameters is not None:
        raise _bad("give the hyperparameters under method.<type>.hyperparameters, not also at "
                   "the top level", "hyperparameters")
    if req.method is None:
        legacy = req.hyperparameters.model_dump(exclude_none=True) if req.hyperparameters else {}
        return entry.method, legacy
    m = req.method
    sections = {"supervised": m.supervised, "dpo": m.dpo, "reinforcement": m.reinforcement}
    if any(v is not None for k, v in sections.items() if k != m.type):
        raise _bad(f"method.type is {m.type!r}: give only method.{m.type}", "method")
    section = sections[m.type]
    if m.type == "reinforcement" and section is None:
        raise _bad("method.reinforcement: the reinforcement method needs a grader "
                   "(method.reinforcement.grader)", "method.reinforcement")
    hyper = section.hyperparameters if section is not None else None
    return m.type, hyper.model_dump(exclude_none=True) if hyper is not None else {}


def _tenant_file(session: Session, tenant: Tenant, file_id: str, param: str) -> File:
    f = None
    if could_be_id(file_id):
        f = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if f is None:
        raise _bad(f"{param}: no file {file_id!r} (upload it with purpose 'fine-tune')", param)
    return f


def _resolve(method_type: str, asked: dict[str, Any], rows: int,
             entry: CatalogModel) -> dict[str, Any]:
    """Every "auto" (or unset) hyperparameter as a number (api/openai/hyperparameters.py)."""

    def given(name: str) -> Any:
        v = asked.get(name, "auto")
        return None if v == "auto" else v

    batch = given("batch_size") or hp.auto_batch_size(rows)
    out: dict[str, Any] = {
        "batch_size": int(batch),
        "n_epochs": int(given("n_epochs") or hp.auto_n_epochs(rows)),
        "learning_rate_multiplier": float(given("learning_rate_multiplier") or 1.0),
    }
    if method_type == "dpo":
        out["beta"] = float(given("beta") or hp.DEFAULT_BETA)
    return out


def _placement(session: Session, entry: CatalogModel, settings: Settings) -> Placement:
    try:
        spec = parse_job_spec({"model": {"name_or_path": entry.location, "task": entry.task},
                               "dataset": {"path": "/", "max_seq_length": entry.max_seq_length},
                               **({"peft": entry.peft} if entry.peft else {})})
    except SpecError:  # the catalog entry's own problem: the submit names it
        return Placement("none", 1, "the catalog entry does not make a valid spec")
    return placement.place(session, settings, spec, entry.gpus)


def _reinforcement_spec(req: JobCreate, entry: CatalogModel, asked: dict[str, Any], seed: int,
                        train: File, placement: Placement,
                        settings: Settings) -> tuple[dict[str, Any], list[str]]:
    """The grpo JobSpec a reinforcement create runs as, and what was said back about its
    hyperparameters. The grader is checked as /v1/graders/validate checks it (python graders
    need the operator's FTUNE_PYTHON_GRADERS), its problems under method.reinforcement.grader;
    the hyperparameters map as api/openai/reinforcement.py says (the learning rate multiplier
    scales the catalog model's rate, as for the other methods)."""
    assert req.method is not None and req.method.reinforcement is not None
    try:
        grader = checked_grader(req.method.reinforcement.grader, settings)
    except InvalidRequest as e:
        raise _under_method(e) from None
    fields, said = openai_reinforcement_fields(asked, placement.num_processes,
                                               entry.learning_rate)
    refused = [n for n in said if n.refused]
    if refused:
        raise _bad(f"method.reinforcement.{refused[0]}", f"method.reinforcement.{refused[0].param}")
    # OpenAI has no answer length: half the model's max_seq_length (the prompt has the
    # rest), at most the spec's default.
    completion = min(GrpoSpec.model_fields["max_completion_length"].default,
                     max(1, entry.max_seq_length // 2))
    training: dict[str, Any] = {
        "objective": "grpo", "seed": seed, "logging_steps": 1,
        "grpo": {"grader": grader.model_dump(mode="json"), "max_completion_length": completion},
    }
    spec: dict[str, Any] = {
        "name": req.suffix,
        "model": {"name_or_path": entry.location, "task": entry.task},
        # The reinforcement layout: chat prompts (the last message the user's) plus the
        # fields the grader reads.
        "dataset": {"file_id": req.training_file, "eval_file_id": req.validation_file,
                    "format": "chat", "max_seq_length": entry.max_seq_length},
        "training": training,
        "distributed": {"strategy": placement.strategy,
                        "num_processes": placement.num_processes},
    }
    for path, value in fields.items():
        node = spec
        *parents, last = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    # A checkpoint per epoch (and an evaluation, with held-out prompts), as the other methods.
    echo = openai_reinforcement_hyperparameters(spec, entry.learning_rate)
    per_epoch = hp.steps_per_epoch(train.rows, echo["batch_size"])
    training["save_steps"] = per_epoch
    if req.validation_file is not None:
        training.setdefault("eval_steps", per_epoch)
    if entry.peft is not None:
        spec["peft"] = entry.peft
    if entry.chat_template is not None:
        spec["dataset"]["chat_template"] = entry.chat_template
    if (tracking := _tracking(req)) is not None:
        spec["tracking"] = tracking
    return spec, [f"method.reinforcement.{n}" for n in said]


def _under_method(e: InvalidRequest) -> InvalidRequest:
    """A grader error (paths below ``grader``) as a problem of the create's request."""
    details = [{**d, "param": f"method.reinforcement.{d['param']}"} for d in e.details or []]
    first = details[0]["param"] if details else "method.reinforcement.grader"
    message = (f"{first}: {details[0]['message']}" if len(details) == 1
               else f"method.reinforcement.grader has {len(details)} problems (see details)")
    return InvalidRequest(message, param=first, code=e.code, details=details)


def _spec(req: JobCreate, entry: CatalogModel, method_type: str, resolved: dict[str, Any],
          seed: int, train: File, placement: Placement) -> dict[str, Any]:
    """The JobSpec this request runs as."""
    batch = hp.split_batch(resolved["batch_size"], placement.num_processes)
    per_epoch = hp.steps_per_epoch(train.rows, resolved["batch_size"])
    training: dict[str, Any] = {
        "num_train_epochs": resolved["n_epochs"],
        "learning_rate": entry.learning_rate * resolved["learning_rate_multiplier"],
        "per_device_train_batch_size": batch.per_device,
        "gradient_accumulation_steps": batch.accumulation,
        "seed": seed,
        # OpenAI reports every step, and keeps a checkpoint per epoch.
        "logging_steps": 1,
        "save_steps": per_epoch,
    }
    if req.validation_file is not None:
        training["eval_steps"] = per_epoch
    if method_type == "dpo":
        training["objective"] = "dpo"
        training["preference"] = {"beta": resolved["beta"]}
    spec: dict[str, Any] = {
        "name": req.suffix,
        "model": {"name_or_path": entry.location, "task": entry.task},
        "dataset": {"file_id": req.training_file, "eval_file_id": req.validation_file,
                    # Detected from the rows among the layouts the objective trains on
                    # (OpenAI's chat with weights and tools, its DPO rows, ...); the job on
                    # /v1/jobs says what was detected (``data``).
                    "format": "auto",
                    "max_seq_length": entry.max_seq_length},
        "training": training,
        "distributed": {"strategy": placement.strategy,
                        "num_processes": placement.num_processes},
    }
    if entry.peft is not None:
        spec["peft"] = entry.peft
    if entry.chat_template is not None:
        spec["dataset"]["chat_template"] = entry.chat_template
    if (tracking := _tracking(req)) is not None:
        spec["tracking"] = tracking
    return spec


def _tracking(req: JobCreate) -> dict[str, Any] | None:
    """The tracking section of a create's ``integrations`` (W&B)."""
    wandb = [i.wandb for i in req.integrations or [] if i.type == "wandb"]
    if not wandb:
        return None
    w = wandb[0]
    tags = {f"wandb.tag.{n}": t[:5000] for n, t in enumerate(w.tags or [])}
    tags["wandb.project"] = w.project
    if w.entity:
        tags["wandb.entity"] = w.entity
    return {"report_to": ["wandb"], "run_name": w.name, "tags": tags}


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


def model_name(tenant: Tenant, job: Job, settings: Settings) -> str:
    """The job's ``ft:`` name (what fine_tuned_model says once it succeeded)."""
    return mapping.model_name_of(job.id, job.name, job.spec or {}, job.openai,
                                 settings.model_catalog, tenant.name)


# --------------------------------------------------------------------------- commands


def cancel(session: Session, tenant: Tenant, job: Job, settings: Settings) -> FineTuningJob:
    return to_openai(session, tenant, jobs.cancel_job(session, job), settings)


def pause(session: Session, tenant: Tenant, job: Job, settings: Settings) -> FineTuningJob:
    return to_openai(session, tenant, jobs.pause_job(session, job), settings)


def resume(session: Session, tenant: Tenant, job: Job, settings: Settings,
           enqueue: Enqueue | None) -> FineTuningJob:
    return to_openai(session, tenant, jobs.resume_job(session, job, enqueue), settings)


# --------------------------------------------------------------------------- models


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


# --------------------------------------------------------------------------- results files


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
