"""What a submit is checked against before anything is recorded: the spec, the request's
files and paths, the data rows, the operator's switches and the fleet (the rate limit is
api/services/rate_limits.py's). Every problem comes back in one SpecError."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.data.consistency import eval_format_problem, label_problems
from core.data.files import DataReport, check_rows
from core.data.formats import CHAT_FORMATS, allowed_formats
from core.db.models import (
    WORKER_GONE,
    File,
    Tenant,
    Worker,
    utcnow,
)
from core.evals.training import job_evaluation_problems
from core.graders.job_checks import RowCheck, grpo_row_check_of
from core.infra import hub
from core.infra.settings import Settings
from core.jobs import queue_load
from core.jobs.continuation import continuation_problems, with_source_defaults
from core.policy import (
    Refused,
    admission,
    chat_template_refusal,
    context_length_refusal,
    data_path,
    fsdp_wrap_classes,
    model_kind,
    model_location,
    pool_from_settings,
    remote_code_refusal,
    stored_upload,
)
from core.policy.fleet import Inventory
from core.spec import (
    DatasetSpec,
    JobSpec,
    ModelSpec,
    Problem,
    SpecError,
    parse_job_spec,
)

log = logging.getLogger("ftune.api")

# Rows a submit renders with the model's tokenizer to find rows without loss tokens.
SUBMIT_RENDER_ROWS = 10_000


@dataclass
class DataSummary:
    train_rows: int | None = None
    eval_rows: int | None = None
    labels: list[str] = field(default_factory=list)
    # Where the data is on disk, once checked (for a dry run's token counts; not stored).
    train_path: Path | None = None
    eval_path: Path | None = None
    # What was read from the training data: format (detected or named), columns used and
    # ignored (core/data/formats Receipt).
    data: dict[str, Any] | None = None
    resolution: Any = None  # core.data.formats Resolution of the training data (not stored)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"train_rows": self.train_rows, "eval_rows": self.eval_rows}
        if self.labels:
            out["labels"] = self.labels
        if self.data is not None:
            out["data"] = self.data
        return out



def validate_submission(
    session: Session, tenant: Tenant, body: Any, *, settings: Settings
) -> tuple[JobSpec, DataSummary]:
    """What submit checks, recording nothing (a dry run): every problem in one SpecError."""
    spec, problems = parse_body(with_source_defaults(session, tenant.id, body))
    summary = check_on_server(session, tenant, settings, body, spec, problems)
    assert spec is not None
    return spec, summary


def parse_body(body: Any) -> tuple[JobSpec | None, list[Problem]]:
    """The spec, or None with its problems (NUL bytes are refused before anything else)."""
    if nul := nul_problems(body):
        raise SpecError(nul)
    try:
        return parse_job_spec(body), []
    except SpecError as e:
        return None, list(e.problems)


def check_on_server(session: Session, tenant: Tenant, settings: Settings, body: Any,
                     spec: JobSpec | None, problems: list[Problem]) -> DataSummary:
    """What the server can check (files, paths, data rows, the fleet), even when the spec
    itself has problems, so the user sees everything in one round trip: raises one
    SpecError with ``problems`` and these, or returns the data summary."""
    model, dataset = _parts(spec, body)
    context, summary = context_problems(session, tenant, settings, model, dataset, spec, body)
    found = [*problems, *context, *continuation_problems(session, tenant.id, body, spec)]
    if spec is not None:
        found.extend(fleet_problems(session, tenant, settings, spec))
        found.extend(job_evaluation_problems(session, tenant.id, settings, spec))
    if found:
        raise SpecError(found)
    return summary


def fleet_problems(
    session: Session, tenant: Tenant, settings: Settings, spec: JobSpec
) -> list[Problem]:
    """The submit stage of admission (core/policy/admission.py): the operator's switches,
    the tenant's bounds and the fleet the workers registered (a SLURM pool configured for
    this process counts too). Files and data rows are checked in ``context_problems``."""
    refusals = admission.submit(spec, settings=settings, tenant=tenant.name,
                                inventories=registered_fleet(session, settings),
                                pool=pool_from_settings(settings))
    return [Problem(r.param, r.message) for r in refusals]


def registered_fleet(session: Session, settings: Settings) -> list[Inventory]:
    """Workers and pools that could take a job: not lost, heart-beating."""
    fresh = utcnow() - timedelta(seconds=settings.heartbeat_timeout_seconds)
    rows = session.scalars(
        select(Worker).where(Worker.state.not_in(WORKER_GONE), Worker.heartbeat_at >= fresh)
    )
    return [queue_load.inventory_of(w) for w in rows]


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


def context_problems(
    session: Session,
    tenant: Tenant,
    settings: Settings,
    model: ModelSpec | None,
    dataset: DatasetSpec | None,
    spec: JobSpec | None,
    body: Any = None,
) -> tuple[list[Problem], DataSummary]:
    """Checks that need the server: files, allowed roots, operator switches, data rows."""
    problems: list[Problem] = []
    summary = DataSummary()
    if model is not None:
        model_problems = _model_problems(model, settings, parsed=spec is not None)
        problems.extend(model_problems)
        if spec is not None and not model_problems:
            problems.extend(_fsdp_layer_problems(spec, settings))
        if dataset is not None and not model_problems:
            # Only a length the user chose: the default is not theirs to be refused for.
            chosen = "max_seq_length" in dataset.model_fields_set
            if chosen and model_kind(model.name_or_path) == "path":
                length = context_length_refusal(
                    Path(model_location(model.name_or_path, settings)), dataset.max_seq_length)
                if length is not None:
                    problems.append(Problem(length.param, length.message))
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
    allowed = _allowed(spec, body)
    row_check = grpo_row_check_of(spec)
    if train is not None:
        train_report = _check_data(
            train[1], dataset, train[0], "", problems, settings, allowed, row_check
        )
        summary.train_rows = train_report.rows if train_report else None
        if train_report is not None and train_report.receipt is not None:
            summary.data = train_report.receipt.to_dict()
            summary.resolution = train_report.resolution
    if evals is not None:
        eval_report = _check_data(
            evals[1], dataset, evals[0], "eval data ", problems, settings, allowed, row_check
        )
        summary.eval_rows = eval_report.rows if eval_report else None
        formats = [r.receipt.format for r in (train_report, eval_report) if r and r.receipt]
        if len(formats) == 2 and (mismatch := eval_format_problem(*formats)) is not None:
            problems.append(Problem(evals[0], mismatch))
    conversational = any(r is not None and r.conversational for r in (train_report, eval_report))
    fmt = summary.data["format"] if summary.data else dataset.format
    model_ok = model is not None and not any(p.param.startswith("model.") for p in problems)
    chatty = fmt in CHAT_FORMATS or conversational
    if model is not None and model_ok and chatty and not any(
        p.param == "dataset.format" for p in problems
    ):
        problems.extend(_chat_template_problems(
                model, dataset, settings, conversational=conversational, fmt=fmt
            ))
    if spec is not None and fmt in CHAT_FORMATS and not problems and summary.train_path:
        problems.extend(_loss_problems(spec, summary, settings))

    if dataset.format == "classification" and train_report is not None:
        summary.labels = train_report.labels
        problems.extend(Problem(param, message) for param, message in label_problems(
            set(train_report.labels),
            eval_labels=eval_report.labels if eval_report is not None else (),
            num_labels=model.num_labels if model is not None else None,
            class_weights=spec.training.class_weights if spec is not None else None,
        ))
    return problems, summary


def _loss_problems(spec: JobSpec, summary: DataSummary, settings: Settings) -> list[Problem]:
    """Rows whose rendering leaves no token to learn (the chat template drops their
    assistant text), found with a local model's tokenizer: named here, or counted in the
    receipt when dataset.skip_rows_without_loss allows it. The first SUBMIT_RENDER_ROWS
    rows only (rendering costs about a tokenizer pass; a submit must answer in seconds);
    hub models, remote code and the rows after those are checked by the trainer, which
    fails the same way."""
    m = spec.model
    if model_kind(m.name_or_path) != "path" or m.trust_remote_code:
        return []
    if summary.resolution is None:
        return []
    from core.data.preview import rows_without_loss
    from core.data.tokenizer import load_tokenizer
    from core.infra.errors import TrainFailure

    assert summary.train_path is not None
    try:
        tok = load_tokenizer(spec, model_location(m.name_or_path, settings))
        count, rows = rows_without_loss(
            spec, tok, summary.train_path, summary.resolution, settings.decompressed_limit,
            limit=SUBMIT_RENDER_ROWS,
        )
    except TrainFailure as e:
        if e.code == "invalid_dataset":
            return [Problem("dataset.chat_template", e.message)]
        log.info("submit: rows not rendered: %s", e)
        return []
    except (OSError, ValueError) as e:
        log.info("submit: rows not rendered: %s", e)
        return []
    if not count:
        return []
    if spec.dataset.skip_rows_without_loss:
        if summary.data is not None:
            summary.data["rows_skipped"], summary.data["skipped_rows"] = count, rows
        return []
    more = f" and {count - len(rows)} more" if count > len(rows) else ""
    return [Problem(
        "dataset.chat_template",
        f"{count} row(s) have no token to learn once rendered with the chat template (rows "
        f"{', '.join(map(str, rows))}{more}): the template drops their assistant text. Use "
        "a template that writes it (dataset.chat_template, e.g. chatml), fix the rows, or "
        "set dataset.skip_rows_without_loss to train without them",
    )]


def _allowed(spec: JobSpec | None, body: Any) -> tuple[str, ...] | None:
    """The formats detection may choose from: those the task and objective train on."""
    if spec is not None:
        return allowed_formats(spec.model.task, spec.training.objective)
    raw = body if isinstance(body, dict) else {}
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
    task = (model or {}).get("task", "causal_lm")
    objective = (training or {}).get("objective", "sft")
    try:
        return allowed_formats(str(task), str(objective))
    except KeyError:
        return None


def _model_problems(m: ModelSpec, settings: Settings, *, parsed: bool) -> list[Problem]:
    """The model's files; and, when the spec as a whole did not parse (so admission's
    rules do not run), its remote code, so the user still sees it in this round trip."""
    out: list[Problem] = []
    try:
        model_location(m.name_or_path, settings, need_config=True)
    except Refused as e:
        out.append(Problem(e.param, e.message))
    else:
        if settings.hub_check and model_kind(m.name_or_path) == "hub":
            # Seconds now rather than a minute of the hub client's retries in the worker.
            hub_refusal = hub.access(m.name_or_path).refusal
            if hub_refusal is not None:
                out.append(Problem("model.name_or_path", hub_refusal))
    refusal = None if parsed else remote_code_refusal(m, allowed=settings.allow_trust_remote_code)
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
    m: ModelSpec,
    dataset: DatasetSpec,
    settings: Settings,
    *,
    conversational: bool = False,
    fmt: str = "chat",
) -> list[Problem]:
    """A local model's tokenizer files must hold a chat template for format chat (and for
    preference/kto rows whose prompt is messages: ``conversational``). Hub models are checked
    by the trainer (the API downloads nothing)."""
    if fmt not in CHAT_FORMATS and not conversational:
        return []
    if model_kind(m.name_or_path) != "path" or dataset.chat_template is not None:
        return []
    refusal = chat_template_refusal(Path(model_location(m.name_or_path, settings)))
    if refusal is None:
        return []
    if fmt not in CHAT_FORMATS:
        return [
            Problem(
                refusal.param,
                f"{fmt} rows whose prompt is a list of messages are rendered with the chat "
                "template, and this model's tokenizer has none; give the prompts as text, "
                "set dataset.chat_template (e.g. chatml), or add a chat template to the model "
                "directory",
            )
        ]
    message = refusal.message.replace("chat needs", f"{fmt} needs").replace(
        "use format", "set dataset.chat_template (e.g. chatml), use format"
    )
    return [Problem(refusal.param, message)]


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
    allowed: tuple[str, ...] | None = None,
    row_check: RowCheck | None = None,
) -> DataReport | None:
    try:
        report = check_rows(
            path, ds, allowed=allowed, max_decompressed_bytes=settings.decompressed_limit,
            row_check=row_check,
        )
    except (UnicodeDecodeError, csv.Error, OSError) as e:
        what = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"unreadable ({e})"
        problems.append(Problem(source_param, f"{prefix}file is {what}".strip()))
        return None
    for p in report.problems:
        param = p.param or source_param
        where = f"{prefix}row {p.row}: " if p.row is not None else prefix
        if p.field is not None and p.row is not None and p.message == "missing":
            text = f"missing field {p.field!r}"
        elif p.field is not None and p.row is not None:
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
