"""Job use-cases: submit (validate, record, enqueue after commit), read, list, cancel, pause,
resume, events."""

from __future__ import annotations

import csv
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError
from sqlalchemy import bindparam, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import RetryLater
from api.schemas import (
    CheckpointObject,
    EventObject,
    JobError,
    JobObject,
    JobUsage,
    Metrics,
    Page,
    Progress,
    QueueInfo,
    TrackingLinks,
)
from api.services import queue
from api.services.pagination import page_after
from core import jobstate, scheduler, usage
from core.continuation import continuation_problems, with_source_defaults
from core.datafiles import DataReport, check_rows
from core.db.models import (
    TERMINAL_STATUSES,
    Checkpoint,
    File,
    Job,
    JobAttempt,
    JobEvent,
    JobStatus,
    Tenant,
    Worker,
    WorkerState,
    new_id,
    utcnow,
)
from core.db.session import after_commit
from core.errors import Conflict
from core.policy import (
    Refused,
    chat_template_refusal,
    data_path,
    fsdp_wrap_classes,
    model_kind,
    model_location,
    pool_from_settings,
    remote_code_refusal,
    slurm_pool_refusal,
    stored_upload,
    tracking_refusals,
)
from core.policy.fleet import Inventory, fleet_refusal
from core.settings import Settings
from core.spec import (
    DatasetSpec,
    JobSpec,
    ModelSpec,
    Problem,
    SpecError,
    parse_job_spec,
    resolved_spec,
)

log = logging.getLogger("ftune.api")

Enqueue = Callable[[str], None]
RATE_WINDOW = timedelta(minutes=1)


# --------------------------------------------------------------------------- submit


@dataclass
class DataSummary:
    train_rows: int | None = None
    eval_rows: int | None = None
    labels: list[str] = field(default_factory=list)
    # Where the data is on disk, once checked (for a dry run's token counts; not stored).
    train_path: Path | None = None
    eval_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"train_rows": self.train_rows, "eval_rows": self.eval_rows}
        if self.labels:
            out["labels"] = self.labels
        return out


def submit_job(
    session: Session,
    tenant: Tenant,
    body: Any,
    *,
    settings: Settings,
    idempotency_key: str | None = None,
    enqueue: Enqueue | None = None,
) -> tuple[Job, bool]:
    """Validate a spec against the request and the server, queue it. Returns (job, created).

    Every problem (field, cross-field, files, paths, data rows) comes back in one SpecError."""
    spec, problems = _parse(with_source_defaults(session, tenant.id, body))
    stored = spec.model_dump(mode="json", exclude_unset=True) if spec is not None else None
    if idempotency_key is not None and stored is not None:
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is not None:
            return _replay(existing, stored, idempotency_key), False

    if spec is not None:
        _check_rate(session, tenant, settings)
    summary = _check_on_server(session, tenant, settings, body, spec, problems)
    assert spec is not None and stored is not None

    now = utcnow()
    job = Job(
        id=new_id("job"),
        tenant_id=tenant.id,
        name=spec.name,
        spec=stored,
        request=body,
        resolved_spec=resolved_spec(spec),
        idempotency_key=idempotency_key,
        created_at=now,
        priority=spec.priority,
    )
    try:
        # A savepoint: the same Idempotency-Key committed concurrently fails only this insert.
        with session.begin_nested():
            jobstate.queue(session, job, now=now, event_data=summary.to_dict())
    except IntegrityError:
        if idempotency_key is None:
            raise
        existing = _by_idempotency_key(session, tenant, idempotency_key)
        if existing is None:
            raise
        return _replay(existing, stored, idempotency_key), False
    after_commit(session, lambda: _enqueue(job.id, enqueue))
    return job, True


def validate_submission(
    session: Session, tenant: Tenant, body: Any, *, settings: Settings
) -> tuple[JobSpec, DataSummary]:
    """What submit checks, recording nothing (a dry run): every problem in one SpecError."""
    spec, problems = _parse(with_source_defaults(session, tenant.id, body))
    summary = _check_on_server(session, tenant, settings, body, spec, problems)
    assert spec is not None
    return spec, summary


def _parse(body: Any) -> tuple[JobSpec | None, list[Problem]]:
    """The spec, or None with its problems (NUL bytes are refused before anything else)."""
    if nul := nul_problems(body):
        raise SpecError(nul)
    try:
        return parse_job_spec(body), []
    except SpecError as e:
        return None, list(e.problems)


def _check_on_server(session: Session, tenant: Tenant, settings: Settings, body: Any,
                     spec: JobSpec | None, problems: list[Problem]) -> DataSummary:
    """What the server can check (files, paths, data rows, the fleet), even when the spec
    itself has problems, so the user sees everything in one round trip: raises one
    SpecError with ``problems`` and these, or returns the data summary."""
    model, dataset = _parts(spec, body)
    context, summary = context_problems(session, tenant, settings, model, dataset, spec)
    found = [*problems, *context, *continuation_problems(session, tenant.id, body, spec)]
    if spec is not None:
        found.extend(fleet_problems(session, tenant, settings, spec))
    if found:
        raise SpecError(found)
    return summary


def fleet_problems(
    session: Session, tenant: Tenant, settings: Settings, spec: JobSpec
) -> list[Problem]:
    """The tenant's priority bound, and a spec that no registered worker (nor pool) could
    ever run (core/policy/fleet.py). With no worker registered yet (an embedded stack
    starting, a fresh deployment) only a multi-machine job is refused (it needs a SLURM
    pool, core/policy/slurm.py); otherwise the worker that claims the job refuses it if it
    cannot run it. A SLURM pool configured for this process adds its own limits (a pool
    registers them too, as its inventory). ``queue_unrunnable`` admits such jobs to wait."""
    out: list[Problem] = []
    bound = settings.tenant_limit(tenant.name, "max_priority")
    if bound is not None and spec.priority > bound:
        out.append(Problem("priority", f"{spec.priority} is above this tenant's bound {bound}"))
    if not settings.queue_unrunnable:
        fleet = registered_fleet(session, settings)
        pool = pool_from_settings(settings)
        found = [fleet_refusal(spec, fleet) if fleet else slurm_pool_refusal(spec, pool)]
        if fleet and pool is not None:
            found.append(slurm_pool_refusal(spec, pool))
        for refusal in found:
            if refusal is not None and all(p.param != refusal.param for p in out):
                out.append(Problem(refusal.param, refusal.message))
    return out


def registered_fleet(session: Session, settings: Settings) -> list[Inventory]:
    """Workers and pools that could take a job: not lost, heart-beating."""
    fresh = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = session.scalars(
        select(Worker).where(Worker.state != WorkerState.lost, Worker.heartbeat_at >= fresh)
    )
    return [scheduler.inventory_of(w) for w in rows]


def nul_problems(value: Any, path: str = "") -> list[Problem]:
    """NUL characters anywhere (keys too): no database text column can store them."""
    if isinstance(value, str):
        return (
            [Problem(path or "body", "must not contain NUL characters")] if "\x00" in value else []
        )
    out: list[Problem] = []
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if "\x00" in str(k):
                out.append(Problem(path or "body", "keys must not contain NUL characters"))
            else:
                out.extend(nul_problems(v, sub))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.extend(nul_problems(v, f"{path}[{i}]" if path else f"[{i}]"))
    return out


def _enqueue(job_id: str, enqueue: Enqueue | None) -> None:
    # Run after the commit: a lost message only delays the job (the reconciler re-enqueues
    # queued jobs), so a broker failure must not fail the request.
    try:
        if enqueue is None:
            from worker.dispatch import enqueue_job

            enqueue = enqueue_job
        enqueue(job_id)
    except Exception:
        log.exception(
            "could not enqueue job %s; the reconciler will retry", job_id, extra={"job_id": job_id}
        )


def _by_idempotency_key(session: Session, tenant: Tenant, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant_id == tenant.id, Job.idempotency_key == key))


def _replay(existing: Job, stored: dict[str, Any], key: str) -> Job:
    if existing.spec != stored:
        raise Conflict(
            f"Idempotency-Key {key!r} was used for job {existing.id} with a different body",
            code="idempotency_conflict",
            param="Idempotency-Key",
        )
    return existing


def _parts(spec: JobSpec | None, body: Any) -> tuple[ModelSpec | None, DatasetSpec | None]:
    if spec is not None:
        return spec.model, spec.dataset
    raw = body if isinstance(body, dict) else {}
    out: list[Any] = []
    for key, cls in (("model", ModelSpec), ("dataset", DatasetSpec)):
        try:
            out.append(cls.model_validate(raw.get(key)))
        except ValidationError:
            out.append(None)
    return out[0], out[1]


def _check_rate(session: Session, tenant: Tenant, settings: Settings) -> None:
    since = utcnow() - RATE_WINDOW
    count, oldest = session.execute(
        select(func.count(Job.id), func.min(Job.created_at)).where(
            Job.tenant_id == tenant.id, Job.created_at >= since
        )
    ).one()
    limit = settings.jobs_per_minute_per_tenant
    if count >= limit:
        retry = math.ceil((oldest - since).total_seconds()) if oldest is not None else 60
        raise RetryLater(f"more than {limit} jobs a minute; retry later", retry_after=retry)


def context_problems(
    session: Session,
    tenant: Tenant,
    settings: Settings,
    model: ModelSpec | None,
    dataset: DatasetSpec | None,
    spec: JobSpec | None,
) -> tuple[list[Problem], DataSummary]:
    """Checks that need the server: files, allowed roots, operator switches, data rows."""
    problems: list[Problem] = []
    summary = DataSummary()
    if spec is not None:
        problems.extend(
            Problem(r.param, r.message) for r in tracking_refusals(spec.tracking, settings)
        )
    if model is not None:
        model_problems = _model_problems(model, settings)
        problems.extend(model_problems)
        if spec is not None and not model_problems:
            problems.extend(_fsdp_layer_problems(spec, settings))
        if dataset is not None and not model_problems:
            problems.extend(_chat_template_problems(model, dataset, settings))
    if dataset is None:
        return problems, summary

    train = _data_source(
        session,
        tenant,
        settings,
        problems,
        "dataset.file_id",
        dataset.file_id,
        "dataset.path",
        dataset.path,
    )
    evals = _data_source(
        session,
        tenant,
        settings,
        problems,
        "dataset.eval_file_id",
        dataset.eval_file_id,
        "dataset.eval_path",
        dataset.eval_path,
    )
    summary.train_path = train[1] if train is not None else None
    summary.eval_path = evals[1] if evals is not None else None
    train_report = eval_report = None
    if train is not None:
        train_report = _check_data(train[1], dataset, train[0], "", problems, settings)
        summary.train_rows = train_report.rows if train_report else None
    if evals is not None:
        eval_report = _check_data(evals[1], dataset, evals[0], "eval data ", problems, settings)
        summary.eval_rows = eval_report.rows if eval_report else None
    conversational = any(r is not None and r.conversational for r in (train_report, eval_report))
    if conversational and model is not None and not any(p.param == "dataset.format" for p in problems):
        problems.extend(_chat_template_problems(model, dataset, settings, conversational=True))

    if dataset.format == "classification" and train_report is not None:
        summary.labels = train_report.labels
        labels = set(train_report.labels)
        if eval_report is not None:
            unknown = sorted(set(eval_report.labels) - labels)
            if unknown:
                problems.append(
                    Problem(
                        "dataset.label_field",
                        f"eval data has labels not in the training data: {', '.join(unknown[:10])}",
                    )
                )
        if model is not None and model.num_labels is not None and len(labels) > model.num_labels:
            problems.append(
                Problem(
                    "model.num_labels",
                    f"the data has {len(labels)} labels, more than num_labels {model.num_labels}",
                )
            )
        weights = spec.training.class_weights if spec is not None else None
        if weights and labels:
            unknown = sorted(set(weights) - labels)
            if unknown:
                problems.append(
                    Problem(
                        "training.class_weights",
                        f"labels not in the data: {', '.join(unknown[:10])}",
                    )
                )
    return problems, summary


def _model_problems(m: ModelSpec, settings: Settings) -> list[Problem]:
    out: list[Problem] = []
    try:
        model_location(m.name_or_path, settings, need_config=True)
    except Refused as e:
        out.append(Problem(e.param, e.message))
    refusal = remote_code_refusal(m, allowed=settings.allow_trust_remote_code)
    if refusal is not None:
        out.append(Problem(refusal.param, refusal.message))
    return out


def _fsdp_layer_problems(spec: JobSpec, settings: Settings) -> list[Problem]:
    """FSDP's layer classes to wrap, checked against a local model built on the meta device
    (config.json only, no weights read). Hub models and remote code are checked by the
    worker (no download, and no repo code runs in the API)."""
    m = spec.model
    if model_kind(m.name_or_path) != "path" or m.trust_remote_code:
        return []
    try:
        path = model_location(m.name_or_path, settings)
        fsdp_wrap_classes(spec, path, trust_remote_code=False)
    except Refused as e:
        return [Problem(e.param, e.message)]
    return []


def _chat_template_problems(
    m: ModelSpec, dataset: DatasetSpec, settings: Settings, *, conversational: bool = False
) -> list[Problem]:
    """A local model's tokenizer files must hold a chat template for format chat (and for
    preference/kto rows whose prompt is messages: ``conversational``). Hub models are checked
    by the trainer (the API downloads nothing)."""
    if dataset.format != "chat" and not conversational:
        return []
    if model_kind(m.name_or_path) != "path":
        return []
    refusal = chat_template_refusal(Path(model_location(m.name_or_path, settings)))
    if refusal is None:
        return []
    if dataset.format != "chat":
        return [
            Problem(
                refusal.param,
                f"{dataset.format} rows whose {dataset.prompt_field!r} is a list of messages "
                "are rendered with the chat template, and this model's tokenizer has none; "
                "give the prompts as text, or add a chat template to the model directory",
            )
        ]
    return [Problem(refusal.param, refusal.message)]


def _data_source(
    session: Session,
    tenant: Tenant,
    settings: Settings,
    problems: list[Problem],
    id_param: str,
    file_id: str | None,
    path_param: str,
    path: str | None,
) -> tuple[str, Path] | None:
    """(param, path on disk) of an uploaded file or a confined path, or None with a problem."""
    found: tuple[str, Path] | None = None
    if file_id is not None:
        f = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
        if f is None:
            problems.append(Problem(id_param, f"no file {file_id!r}"))
        else:
            try:
                found = id_param, stored_upload(file_id, f.storage_path, settings, id_param)
            except Refused as e:
                problems.append(Problem(e.param, e.message))
    if path is not None:
        try:
            confined = data_path(path, settings, path_param)
        except Refused as e:
            problems.append(Problem(e.param, e.message))
        else:
            found = found or (path_param, confined)
    return found


def _check_data(
    path: Path,
    ds: DatasetSpec,
    source_param: str,
    prefix: str,
    problems: list[Problem],
    settings: Settings,
) -> DataReport | None:
    try:
        report = check_rows(path, ds, max_decompressed_bytes=settings.decompressed_limit)
    except (UnicodeDecodeError, csv.Error, OSError) as e:
        what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"unreadable ({e})"
        problems.append(Problem(source_param, f"{prefix}file is {what}".strip()))
        return None
    params = {column: param for param, column in ds.required_fields()}
    for p in report.problems:
        param = source_param
        if p.field is not None:
            param = params.get(p.field.split("[", 1)[0], source_param)
        where = f"{prefix}row {p.row}: " if p.row is not None else prefix
        if p.field is not None and p.message == "missing":
            text = f"missing field {p.field!r}"
        elif p.field is not None:
            text = f"field {p.field!r}: {p.message}"
        else:
            text = p.message
        problems.append(Problem(param, f"{where}{text}"))
    hidden = report.problem_count - len(report.problems)
    if hidden > 0:
        problems.append(
            Problem(
                source_param,
                f"{prefix}{hidden} more problems not listed "
                f"({report.problem_count} in all)".strip(),
            )
        )
    return report


# --------------------------------------------------------------------------- read


def job_object(
    job: Job,
    checkpoints_count: int,
    now: datetime | None = None,
    attempts: list[JobAttempt] | None = None,
    settings: Settings | None = None,
    queue: QueueInfo | None = None,
) -> JobObject:
    now = now or utcnow()
    price = settings.price_per_gpu_hour if settings is not None else None
    currency = settings.price_currency if settings is not None else ""
    totals = usage.job_totals(attempts or [], now).as_dict(price, currency)
    percent = eta = None
    if job.total_steps:
        percent = round(min(job.step / job.total_steps, 1.0) * 100, 2)
        if (
            job.status in (JobStatus.running, JobStatus.cancelling)
            and job.training_started_at is not None
            and 0 < job.step < job.total_steps
        ):
            elapsed = (now - job.training_started_at).total_seconds()
            eta = round(max(elapsed, 0.0) / job.step * (job.total_steps - job.step), 1)
    error = None
    if job.error_code:
        error = JobError(code=job.error_code, message=job.error_message or "")
    return JobObject(
        id=job.id,
        name=job.name,
        status=job.status,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        spec=job.resolved_spec or job.spec,
        request=job.request if job.request is not None else job.spec,
        run=job.run_info,
        usage=JobUsage(**totals, epochs=job.epoch),
        progress=Progress(
            step=job.step,
            total_steps=job.total_steps,
            epoch=job.epoch,
            percent=percent,
            eta_seconds=eta,
        ),
        metrics=Metrics(
            train_loss=job.train_loss,
            eval_loss=job.eval_loss,
            learning_rate=job.learning_rate,
            tokens_per_second=job.tokens_per_second,
            peak_memory_mb=job.peak_memory_mb,
            preference=job.preference_metrics,
        ),
        checkpoints_count=checkpoints_count,
        adapter_available=job.status == JobStatus.succeeded and job.adapter_path is not None,
        attempt=job.attempt,
        pauses=job.pauses or 0,
        error=error,
        tracking=tracking_links(job),
        waiting_for=job.waiting_for,
        priority=job.priority,
        queue=queue,
    )


def tracking_links(job: Job) -> TrackingLinks | None:
    """jobs.tracking (the trainer's "tracking" event) as links; None before it came."""
    runs = job.tracking
    if not runs:
        return None
    try:
        return TrackingLinks(
            tensorboard=f"/v1/jobs/{job.id}/tensorboard" if "tensorboard" in runs else None,
            mlflow=runs.get("mlflow"),
            wandb=runs.get("wandb"),
        )
    except ValidationError:  # written by the trainer: show nothing rather than fail the read
        log.warning("job %s: unreadable tracking links %r", job.id, runs)
        return None


def job_objects(
    session: Session, jobs: list[Job], settings: Settings | None = None
) -> list[JobObject]:
    counts: dict[str, int] = {}
    if jobs:
        counts = dict(
            session.execute(  # type: ignore[arg-type]
                select(Checkpoint.job_id, func.count(Checkpoint.id))
                .where(Checkpoint.job_id.in_([j.id for j in jobs]))
                .group_by(Checkpoint.job_id)
            ).all()
        )
    now = utcnow()
    attempts = usage.attempts_of(session, [j.id for j in jobs])
    queues = queue.queue_infos(session, [j for j in jobs if j.status == JobStatus.queued],
                               _settings_of(session, settings), now)
    return [
        job_object(j, counts.get(j.id, 0), now, attempts.get(j.id), settings, queues.get(j.id))
        for j in jobs
    ]


def _settings_of(session: Session, settings: Settings | None) -> Settings:
    if settings is not None:
        return settings
    given: Settings | None = session.info.get("settings")
    if given is not None:
        return given
    from core.settings import get_settings

    return get_settings()


# The hot reads (every poll of a job) use statements built once: building one per call, with
# its cache key, costs SQLAlchemy several times what SQLite spends answering it.
_TENANT_JOB = select(Job).where(
    Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id")
)
_CHECKPOINTS_COUNT = select(func.count(Checkpoint.id)).where(
    Checkpoint.job_id == bindparam("job_id")
)
# GET /v1/jobs/{id} reads rows of the jobs and job_attempts tables, not ORM instances: a
# row has each column as an attribute (the models name attributes as their columns), and
# loading instances cost the ORM twice what SQLite spends answering (0.55 vs 0.26 ms a job
# here). The job and its checkpoint count come in one statement.
_JOB_ROW = select(
    *Job.__table__.c,
    select(func.count(Checkpoint.id)).where(Checkpoint.job_id == Job.id)
    .correlate(Job).scalar_subquery().label("checkpoints_count"),
).where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))
_ATTEMPT_ROWS = (select(*JobAttempt.__table__.c)
                 .where(JobAttempt.job_id == bindparam("job_id")).order_by(JobAttempt.attempt))


def find_tenant_job(session: Session, tenant_id: str, job_id: str) -> Job | None:
    return session.scalar(_TENANT_JOB, {"job_id": job_id, "tenant_id": tenant_id})


def get_job_object(session: Session, job: Job, settings: Settings | None = None) -> JobObject:
    count = session.scalar(_CHECKPOINTS_COUNT, {"job_id": job.id}) or 0
    attempts = usage.attempts_of(session, [job.id])[job.id]
    return _with_queue(session, job, count, attempts, settings)


def read_job_object(session: Session, tenant_id: str, job_id: str,
                    settings: Settings | None = None) -> JobObject | None:
    """GET /v1/jobs/{id}: the tenant's job as the API shows it, or None."""
    conn = session.connection()
    row = conn.execute(_JOB_ROW, {"job_id": job_id, "tenant_id": tenant_id}).first()
    if row is None:
        return None
    # Rows stand in for the models they have the columns of (see _JOB_ROW).
    attempts = conn.execute(_ATTEMPT_ROWS, {"job_id": job_id}).all() if row.attempt else []
    return _with_queue(session, cast(Job, row), row.checkpoints_count or 0,
                       cast(list[JobAttempt], attempts), settings)


def _with_queue(session: Session, job: Job, checkpoints: int, attempts: list[JobAttempt],
                settings: Settings | None) -> JobObject:
    now = utcnow()
    info = (queue.queue_infos(session, [job], _settings_of(session, settings), now).get(job.id)
            if job.status == JobStatus.queued else None)
    return job_object(job, checkpoints, now, attempts, settings, info)


def list_jobs(
    session: Session,
    tenant: Tenant,
    status: JobStatus | None,
    limit: int,
    after: str | None,
    settings: Settings | None = None,
) -> Page[JobObject]:
    q = select(Job).where(Job.tenant_id == tenant.id)
    if status is not None:
        q = q.where(Job.status == status)
    rows, has_more = page_after(session, q, Job, tenant.id, limit, after)
    return Page(
        data=job_objects(session, rows, settings),
        has_more=has_more,
        next_cursor=rows[-1].id if has_more else None,
    )


# --------------------------------------------------------------------------- cancel


def cancel_job(session: Session, job: Job) -> Job:
    """Idempotent: queued or paused -> cancelled now; running or pausing -> cancelling (the
    worker stops it); cancelling or finished -> unchanged. Each move is guarded by the
    status it was read in, so a job that changes state meanwhile (a worker claims it) is
    handled in its new state."""
    for _ in range(3):
        previous = job.status
        if previous not in (JobStatus.queued, JobStatus.running, JobStatus.paused,
                            JobStatus.pausing):
            return job
        changed = jobstate.request_cancel(session, job.id, previous=previous, now=utcnow())
        session.refresh(job)
        if changed:
            return job
    return job


# --------------------------------------------------------------------------- pause, resume


def pause_job(session: Session, job: Job) -> Job:
    """Idempotent: queued -> paused now; running -> pausing (its worker stops the trainer at
    a checkpoint, then marks it paused); pausing or paused -> unchanged. Conflict from any
    other status. Guarded by the status it was read in, like a cancel."""
    for _ in range(3):
        previous = job.status
        if previous in (JobStatus.pausing, JobStatus.paused):
            return job
        if previous not in (JobStatus.queued, JobStatus.running):
            raise Conflict(f"job {job.id} is {previous}: only a queued or running job can be "
                           "paused", code="job_not_pausable", param="status")
        changed = jobstate.request_pause(session, job.id, previous=previous, now=utcnow())
        session.refresh(job)
        if changed:
            return job
    return job


def resume_job(session: Session, job: Job, enqueue: Enqueue | None = None) -> Job:
    """Idempotent: paused -> queued, enqueued after the commit (any worker continues from
    the latest checkpoint); queued or running -> unchanged. Conflict while the pause is
    still being enforced (pausing) and from any other status."""
    for _ in range(3):
        previous = job.status
        if previous in (JobStatus.queued, JobStatus.running):
            return job
        if previous == JobStatus.pausing:
            raise Conflict(f"job {job.id} is still pausing (its worker is saving a checkpoint "
                           "and stopping the run): resume it once it is paused",
                           code="job_not_resumable", param="status")
        if previous != JobStatus.paused:
            raise Conflict(f"job {job.id} is {previous}: only a paused job can be resumed",
                           code="job_not_resumable", param="status")
        changed = jobstate.resume(session, job.id, now=utcnow())
        session.refresh(job)
        if changed:
            after_commit(session, functools.partial(_enqueue, job.id, enqueue))
            return job
    return job


# --------------------------------------------------------------------------- events, checkpoints


def event_object(e: JobEvent) -> EventObject:
    return EventObject(
        id=e.id, created_at=e.created_at, type=e.type, message=e.message or "", data=e.data or {}
    )


def events_after(session: Session, job_id: str, after: int | None, limit: int) -> list[JobEvent]:
    q = select(JobEvent).where(JobEvent.job_id == job_id)
    if after is not None:
        q = q.where(JobEvent.id > after)
    return list(session.scalars(q.order_by(JobEvent.id).limit(limit)))


def list_events(session: Session, job: Job, after: int | None, limit: int) -> Page[EventObject]:
    rows = events_after(session, job.id, after, limit + 1)
    has_more = len(rows) > limit
    rows = rows[:limit]
    return Page(
        data=[event_object(e) for e in rows],
        has_more=has_more,
        next_cursor=str(rows[-1].id) if has_more else None,
    )


def is_terminal(status: str) -> bool:
    return status in TERMINAL_STATUSES


def relative_to_job_dir(job: Job, path: str) -> str:
    """Checkpoint paths are recorded absolute by the worker; clients see them relative."""
    p = Path(path)
    if not job.job_dir or not p.is_absolute():
        return path
    for root, candidate in ((Path(job.job_dir), p), (Path(job.job_dir).resolve(), p.resolve())):
        if candidate.is_relative_to(root):
            return str(candidate.relative_to(root))
    return p.name


def list_checkpoints(session: Session, job: Job) -> Page[CheckpointObject]:
    rows = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step)
    ).all()
    return Page(
        data=[
            CheckpointObject(
                step=c.step,
                path=relative_to_job_dir(job, c.path),
                metrics=c.metrics or {},
                created_at=c.created_at,
            )
            for c in rows
        ]
    )
