"""Evaluation inside fine-tuning (issue 33 point 4), the part that needs no serving path: the
job spec's ``evaluation`` section and its submit-time check.

A job names evals (the tenant's) with the data each is run on; the base model, each kept
checkpoint and the final model are each run as a completions run of every eval (model = the
catalog id, then ``ft:...:ckpt-step-N``, then the job's ``ft:`` name), and ``select_best`` may
make the best checkpoint by one criterion the job's result. What is refused at submit, naming
the field: an eval that is not the tenant's, templates or rows that do not meet the eval's
item schema (row numbers), a select_best criterion the eval does not have.

Not wired yet: JobSpec has no ``evaluation`` field until the serving path (deployments of a
checkpoint's adapter) can run what it asks; see docs/evals.md."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from core.data.reading import DataFileError
from core.db.models import Eval, File
from core.evals import checks
from core.evals.rows import content_rows, file_rows
from core.evals.spec import (
    CompletionsDataSource,
    CompletionsSamplingParams,
    FileContentSource,
    InputMessages,
    ItemReferenceInput,
    Source,
)
from core.infra.settings import Settings
from core.policy import Refused, stored_upload
from core.spec import Problem

MAX_EVALS = 8
Stage = Literal["base", "checkpoints", "final"]
STAGES: tuple[Stage, ...] = ("base", "checkpoints", "final")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvalOnTraining(_Strict):
    eval_id: str = Field(max_length=64, description="An eval of yours (POST /v1/evals).")
    input_messages: InputMessages
    sampling_params: CompletionsSamplingParams | None = None
    source: Source


class SelectBest(_Strict):
    eval_id: str = Field(max_length=64, description="One of evaluation.evals.")
    criterion: str = Field(description="A testing criterion of that eval, by name.")
    by: Literal["pass_rate", "mean_score"] = Field(
        default="pass_rate", description="Which of the criterion's figures ranks checkpoints.")


class EvaluationSpec(_Strict):
    evals: list[EvalOnTraining] = Field(min_length=1, max_length=MAX_EVALS)
    on: list[Stage] = Field(
        default_factory=lambda: list(STAGES),
        description="Which models are evaluated.")
    select_best: SelectBest | None = Field(
        default=None, description="Make the best checkpoint by this criterion the job's result "
        "(fine_tuned_model names it; an event says why).")


def evaluation_problems(session: Session, tenant_id: str, settings: Settings,
                        spec: EvaluationSpec, prefix: str = "evaluation") -> list[Problem]:
    out: list[Problem] = []
    found: dict[str, Eval] = {}
    for i, e in enumerate(spec.evals):
        param = f"{prefix}.evals[{i}]"
        ev = session.scalar(select(Eval).where(Eval.id == e.eval_id, Eval.tenant_id == tenant_id))
        if ev is None:
            out.append(Problem(f"{param}.eval_id", f"no eval {e.eval_id!r} of yours"))
            continue
        found[e.eval_id] = ev
        schema = ev.data_source_config["item_schema"]
        ds = CompletionsDataSource(type="completions", model="-", input_messages=e.input_messages,
                                   sampling_params=e.sampling_params, source=e.source)
        out.extend(Problem(p.param.replace("data_source", param, 1), p.message)
                   for p in checks.input_problems(ds, schema))
        try:
            rows = _rows(session, tenant_id, settings, e.source)
        except (DataFileError, Refused) as exc:
            out.append(Problem(f"{param}.source", str(exc)))
            continue
        if rows is None:
            out.append(Problem(f"{param}.source.id", f"no file {getattr(e.source, 'id', '')!r} "
                               "of yours with purpose 'evals'"))
            continue
        ref = (e.input_messages.item_reference
               if isinstance(e.input_messages, ItemReferenceInput) else None)
        for n, message in checks.row_problems(rows, schema, needs_sample=False,
                                              item_reference=ref):
            where = (f"{param}.source.content[{n}]" if isinstance(e.source, FileContentSource)
                     else f"{param}.source.id")
            text = message if isinstance(e.source, FileContentSource) else f"row {n + 1}: {message}"
            out.append(Problem(where, text))
    best = spec.select_best
    if best is not None:
        if best.eval_id not in {e.eval_id for e in spec.evals}:
            out.append(Problem(f"{prefix}.select_best.eval_id",
                               f"{best.eval_id!r} is not one of evaluation.evals"))
        elif (ev := found.get(best.eval_id)) is not None:
            names = [c["name"] for c in ev.testing_criteria]
            if best.criterion not in names:
                out.append(Problem(f"{prefix}.select_best.criterion",
                                   f"eval {ev.id} has no criterion {best.criterion!r} (it has "
                                   f"{', '.join(names)})"))
    return out


def _rows(session: Session, tenant_id: str, settings: Settings,
          source: Source) -> list[tuple[int, dict[str, object]]] | None:
    if isinstance(source, FileContentSource):
        return content_rows(source)
    f = session.scalar(select(File).where(File.id == source.id, File.tenant_id == tenant_id,
                                          File.purpose == "evals"))
    if f is None:
        return None
    path = stored_upload(f.id, f.storage_path, settings, "source.id", size=f.bytes,
                         sha256=f.sha256)
    return list(file_rows(Path(path), settings.decompressed_limit))
