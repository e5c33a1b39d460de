"""Evaluation inside fine-tuning (issue 33 point 4), at submit: the job spec's ``evaluation``
section (core/spec/evaluation.py) checked against the tenant's evals and files, and against
what the serving path can serve. core/evals/job_evaluation.py runs it on the worker.

Refused, naming the field: an eval that is not the tenant's, templates or rows that do not
meet the eval's item schema (row numbers), a select_best criterion the eval does not have or
without checkpoints to choose from, a base stage whose base model is no catalog model (the
serving path serves bases by their catalog id), and a PEFT method the engine cannot serve
(vLLM serves LoRA adapters and full models)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.data.reading import DataFileError
from core.db.models import Eval, File
from core.evals import checks
from core.evals.execute import CRITERIA
from core.evals.rows import content_rows, file_rows
from core.evals.spec import CompletionsDataSource
from core.infra.settings import Settings
from core.policy import Refused, stored_upload
from core.spec import Problem
from core.spec.evaluation import (
    EvaluationSpec,
    FileContentSource,
    ItemReferenceInput,
    Source,
)
from core.spec.job import JobSpec
from core.spec.peft import FullSpec, LoraSpec

SERVABLE = (LoraSpec, FullSpec)  # what vLLM serves: LoRA adapters and whole models


def job_evaluation_problems(session: Session, tenant_id: str, settings: Settings,
                            spec: JobSpec) -> list[Problem]:
    """The submit check of a job's ``evaluation`` (none: nothing to check)."""
    ev = spec.evaluation
    if ev is None:
        return []
    out = evaluation_problems(session, tenant_id, settings, ev)
    if not isinstance(spec.peft, SERVABLE):
        out.append(Problem("evaluation", f"peft.method {spec.peft.method}: the engine serves "
                           "LoRA adapters and full models only, so this job's checkpoints "
                           "cannot be evaluated"))
    location = spec.model.name_or_path
    if "base" in ev.on and not any(e.location == location
                                   for e in settings.model_catalog.values()):
        out.append(Problem("evaluation.on", f"'base': the base model {location!r} is no "
                           "catalog model (FTUNE_MODEL_CATALOG), and bases are served by "
                           "their catalog id; leave 'base' out, or name a catalog model"))
    if ev.select_best is not None and "checkpoints" not in ev.on:
        out.append(Problem("evaluation.select_best", "chooses among the checkpoints: add "
                           "'checkpoints' to evaluation.on"))
    return out


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
            rows = source_rows(session, tenant_id, settings, e.source)
        except (DataFileError, Refused) as exc:
            out.append(Problem(f"{param}.source", str(exc)))
            continue
        if rows is None:
            out.append(Problem(f"{param}.source.id", f"no file {getattr(e.source, 'id', '')!r} "
                               "of yours with purpose 'evals'"))
            continue
        ref = (e.input_messages.item_reference
               if isinstance(e.input_messages, ItemReferenceInput) else None)
        bad = checks.row_problems(rows, schema, needs_sample=False, item_reference=ref)
        criteria = CRITERIA.validate_python(ev.testing_criteria)
        bad += [(n, f"item has no field {'.'.join(path)!r}, which criterion {name!r} reads")
                for n, row in rows if n not in {b for b, _ in bad}
                for name, path in checks.criterion_item_fields(criteria)
                if checks.lacking_field(row.get("item") or {}, path)]
        for n, message in sorted(bad):
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


def source_rows(session: Session, tenant_id: str, settings: Settings,
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
