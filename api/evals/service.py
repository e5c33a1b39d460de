"""The Evals API's use cases: evals, runs (queued for the workers, core/evals/execute.py runs
them), output items and the comparison of two runs. Everything is the caller's tenant's:
another tenant's eval, run, file or model reads as one that does not exist."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import Select, and_, or_, select
from sqlalchemy.orm import Session

from api.evals.schemas import (
    CriterionComparison,
    CustomConfigOut,
    EvalDeleted,
    EvalList,
    EvalOut,
    FlippedItem,
    OutputItemOut,
    RunComparison,
    RunDeleted,
    RunOut,
)
from api.services.pagination import could_be_id
from core.data.reading import DataFileError
from core.db.models import Eval, EvalOutputItem, EvalRun, File, Tenant
from core.db.session import after_commit
from core.evals import checks, store
from core.evals.compare import Graded, compare
from core.evals.rows import content_rows, file_rows
from core.evals.spec import (
    CRITERION_TYPES,
    CompletionsDataSource,
    EvalCreate,
    EvalUpdate,
    FileContentSource,
    ItemReferenceInput,
    RunCreate,
)
from core.graders.config import GraderRuntime
from core.infra.errors import Conflict, InvalidRequest, NotFound
from core.infra.settings import Settings
from core.policy import Refused, stored_upload
from core.spec import Problem
from core.spec.graders import is_union_tag

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
EnqueueRun = Callable[[str], None]
ModelCheck = Callable[[str], None]  # raises NotFound for a model the tenant cannot use
SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "choices": {"type": "array"},
        "output_text": {"type": "string"},
        "output_json": {"type": "object"},
    },
    "required": ["model", "output_text"],
}
# Discriminated unions whose member name pydantic puts into an error's location.
_UNION_TAGS = {"data_source": {"completions", "jsonl"}, "source": {"file_content", "file_id"},
               "input_messages": {"template", "item_reference"}}


def _unix(dt: Any) -> int | None:
    return int(dt.timestamp()) if dt is not None else None


def _param(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for i, p in enumerate(loc):
        prev = loc[i - 1] if i else None
        if isinstance(p, str) and (
                (isinstance(prev, str) and p in _UNION_TAGS.get(prev, ()))
                or (isinstance(prev, int) and p in CRITERION_TYPES)
                or is_union_tag(loc, i)):
            continue
        parts.append(f"[{p}]" if isinstance(p, int) else ("." if parts else "") + str(p))
    return "".join(parts)


def _invalid(problems: list[Problem]) -> InvalidRequest:
    details = [p.to_dict() for p in problems]
    first = problems[0]
    more = f" (and {len(problems) - 1} more: see details)" if len(problems) > 1 else ""
    return InvalidRequest(f"{first.param}: {first.message}{more}", param=first.param,
                          details=details)


def _parse(model: type[M], body: Any) -> M:
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", param=None)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            param = _param(tuple(err["loc"])) or "body"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = f"Unrecognized request argument supplied: {param}"
            problems.append(Problem(param, msg))
        raise _invalid(problems) from None


# --------------------------------------------------------------------------- evals


def eval_out(ev: Eval) -> EvalOut:
    cfg = ev.data_source_config
    props: dict[str, Any] = {"item": cfg["item_schema"]}
    if cfg.get("include_sample_schema"):
        props["sample"] = SAMPLE_SCHEMA
    schema = {"type": "object", "properties": props, "required": sorted(props)}
    return EvalOut(id=ev.id, name=ev.name, created_at=_unix(ev.created_at) or 0,
                   metadata=ev.meta, data_source_config=CustomConfigOut(schema=schema),
                   testing_criteria=ev.testing_criteria)


def create_eval(session: Session, tenant: Tenant, body: Any, settings: Settings) -> EvalOut:
    if isinstance(body, dict) and isinstance(body.get("data_source_config"), dict):
        kind = body["data_source_config"].get("type")
        if kind in ("logs", "stored_completions"):
            raise InvalidRequest(f"data_source_config.type: {kind} reads OpenAI's stored "
                                 "logs, which ftune does not keep; use custom with an "
                                 "item_schema", param="data_source_config.type")
    req = _parse(EvalCreate, body)
    can = GraderRuntime.from_settings(settings).capabilities()
    problems = checks.schema_problems(req.data_source_config)
    if not problems:
        problems = checks.criteria_problems(req.testing_criteria, req.data_source_config, can)
    if problems:
        raise _invalid(problems)
    ev = Eval(tenant_id=tenant.id, name=req.name or "", meta=req.metadata,
              data_source_config=req.data_source_config.model_dump(mode="json"),
              testing_criteria=[c.model_dump(mode="json", exclude_none=True)
                                for c in req.testing_criteria])
    session.add(ev)
    session.flush()
    return eval_out(ev)


def find_eval(session: Session, tenant: Tenant, eval_id: str) -> Eval:
    ev = None
    if could_be_id(eval_id):
        ev = session.scalar(select(Eval).where(Eval.id == eval_id, Eval.tenant_id == tenant.id))
    if ev is None:
        raise NotFound(f"no eval {eval_id!r}", param="eval_id")
    return ev


def update_eval(session: Session, ev: Eval, body: Any) -> EvalOut:
    req = _parse(EvalUpdate, body)
    if req.name is not None:
        ev.name = req.name
    if "metadata" in (body or {}):
        ev.meta = req.metadata
    session.flush()
    return eval_out(ev)


def delete_eval(session: Session, ev: Eval) -> EvalDeleted:
    busy = session.scalar(select(EvalRun.id).where(EvalRun.eval_id == ev.id,
                                                   EvalRun.status.in_(store.UNFINISHED)))
    if busy is not None:
        raise Conflict(f"run {busy} of this eval has not finished: cancel it first",
                       param="eval_id")
    session.delete(ev)
    return EvalDeleted(eval_id=ev.id)


def _page(session: Session, q: Select[Any], model: Any, after_row: Any | None,
             limit: int, order: str) -> tuple[list[Any], bool]:
    desc = order == "desc"
    if after_row is not None:
        at, aid = after_row.created_at, after_row.id
        q = q.where(or_(model.created_at < at, and_(model.created_at == at, model.id < aid))
                    if desc else
                    or_(model.created_at > at, and_(model.created_at == at, model.id > aid)))
    keys = (model.created_at.desc(), model.id.desc()) if desc else (model.created_at, model.id)
    rows = list(session.scalars(q.order_by(*keys).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def _cursor(find: Callable[[str], Any], after: str | None) -> Any:
    """The object ``after`` names (a list continues after it), or a 400 naming ``after``."""
    if after is None:
        return None
    try:
        return find(after)
    except NotFound:
        raise InvalidRequest(f"after: no object {after!r} to continue after",
                             param="after") from None


def _list(data: list[T], has_more: bool) -> EvalList[T]:
    ids = [getattr(d, "id", None) for d in data]
    return EvalList[T](data=data, has_more=has_more, first_id=ids[0] if ids else None,
                       last_id=ids[-1] if ids else None)


def list_evals(session: Session, tenant: Tenant, limit: int, after: str | None,
               order: str) -> EvalList[EvalOut]:
    anchor = _cursor(lambda a: find_eval(session, tenant, a), after)
    rows, more = _page(session, select(Eval).where(Eval.tenant_id == tenant.id), Eval, anchor,
                       limit, order)
    return _list([eval_out(e) for e in rows], more)


# --------------------------------------------------------------------------- runs


def run_out(session: Session, run: EvalRun, base_url: str) -> RunOut:
    if run.result_counts is None or run.status in store.UNFINISHED:
        summary = store.summarize(store.item_rows(session, run.id))
    else:
        summary = {"result_counts": run.result_counts,
                   "per_testing_criteria_results": run.per_testing_criteria_results or [],
                   "per_model_usage": run.per_model_usage or []}
    return RunOut.model_validate({
        "id": run.id, "eval_id": run.eval_id, "name": run.name, "model": run.model,
        "status": run.status, "created_at": _unix(run.created_at) or 0,
        "data_source": run.data_source,
        "error": {"code": run.error_code or "", "message": run.error_message or ""},
        "metadata": run.meta, **summary,
        "report_url": f"{base_url.rstrip('/')}/ui#/evals/{run.eval_id}/runs/{run.id}",
        "started_at": _unix(run.started_at), "finished_at": _unix(run.finished_at),
        "attempt": run.attempt,
    })


def create_run(session: Session, tenant: Tenant, ev: Eval, body: Any, settings: Settings,
               model_check: ModelCheck, enqueue: EnqueueRun, base_url: str) -> RunOut:
    if isinstance(body, dict) and isinstance(body.get("data_source"), dict) \
            and body["data_source"].get("type") == "responses":
        raise InvalidRequest("data_source.type: the responses data source is not served here "
                             "(ftune has no Responses API); use completions (chat messages "
                             "to a model) or jsonl (given answers)", param="data_source.type")
    req = _parse(RunCreate, body)
    ds = req.data_source
    schema = ev.data_source_config["item_schema"]
    problems: list[Problem] = []
    model = ""
    if isinstance(ds, CompletionsDataSource):
        model = ds.model
        try:
            model_check(ds.model)
        except NotFound:
            problems.append(Problem("data_source.model", f"model {ds.model!r}: no such model "
                                    "of yours (GET /v1/models lists them)"))
        problems += checks.input_problems(ds, schema)
    if problems:
        raise _invalid(problems)
    rows, param = _run_rows(session, tenant, ds.source, settings)
    reference = (ds.input_messages.item_reference if isinstance(ds, CompletionsDataSource)
                 and isinstance(ds.input_messages, ItemReferenceInput) else None)
    bad = checks.row_problems(rows, schema, needs_sample=not isinstance(ds, CompletionsDataSource),
                              item_reference=reference)
    if bad:
        if isinstance(ds.source, FileContentSource):
            raise _invalid([Problem(f"data_source.source.content[{n}]", m) for n, m in bad])
        raise _invalid([Problem(param, f"row {n + 1}: {m}") for n, m in bad])
    run = EvalRun(eval_id=ev.id, tenant_id=tenant.id, name=req.name or "", meta=req.metadata,
                  model=model, data_source=ds.model_dump(mode="json", exclude_none=True),
                  status=store.QUEUED, items_total=len(rows), attempt=0,
                  generation_seconds=0.0, grading_seconds=0.0)
    session.add(run)
    session.flush()
    run_id = run.id
    after_commit(session, lambda: enqueue(run_id))
    return run_out(session, run, base_url)


def _run_rows(session: Session, tenant: Tenant, source: Any,
              settings: Settings) -> tuple[list[tuple[int, dict[str, Any]]], str]:
    if isinstance(source, FileContentSource):
        return content_rows(source), "data_source.source.content"
    param = "data_source.source.id"
    f = None
    if could_be_id(source.id):
        f = session.scalar(select(File).where(File.id == source.id, File.tenant_id == tenant.id))
    if f is None:
        raise InvalidRequest(f"{param}: no file {source.id!r} (upload it with purpose "
                             "'evals')", param=param)
    if f.purpose != "evals":
        raise InvalidRequest(f"{param}: file {f.id} was uploaded with purpose {f.purpose!r}; "
                             "an eval's items are uploaded with purpose 'evals'", param=param)
    try:
        path = stored_upload(f.id, f.storage_path, settings, param, size=f.bytes,
                             sha256=f.sha256)
        return list(file_rows(Path(path), settings.decompressed_limit)), param
    except Refused as e:
        raise InvalidRequest(f"{param}: {e}", param=param) from None
    except DataFileError as e:
        raise InvalidRequest(f"{param}: {e}", param=param) from None


def find_run(session: Session, ev: Eval, run_id: str) -> EvalRun:
    run = None
    if could_be_id(run_id):
        run = session.scalar(select(EvalRun).where(EvalRun.id == run_id,
                                                   EvalRun.eval_id == ev.id))
    if run is None:
        raise NotFound(f"no run {run_id!r} of eval {ev.id}", param="run_id")
    return run


def list_runs(session: Session, ev: Eval, limit: int, after: str | None, order: str,
              status: str | None, base_url: str) -> EvalList[RunOut]:
    anchor = _cursor(lambda a: find_run(session, ev, a), after)
    q = select(EvalRun).where(EvalRun.eval_id == ev.id)
    if status is not None:
        q = q.where(EvalRun.status == status)
    rows, more = _page(session, q, EvalRun, anchor, limit, order)
    return _list([run_out(session, r, base_url) for r in rows], more)


def cancel_run(session: Session, run: EvalRun, base_url: str) -> RunOut:
    return run_out(session, store.cancel(session, run), base_url)


def delete_run(session: Session, run: EvalRun) -> RunDeleted:
    if run.status in store.UNFINISHED:
        raise Conflict(f"run {run.id} is {run.status}: cancel it first", param="run_id")
    session.delete(run)
    return RunDeleted(run_id=run.id)


# --------------------------------------------------------------------------- output items


def item_out(it: EvalOutputItem) -> OutputItemOut:
    return OutputItemOut(id=it.id, eval_id=it.eval_id, run_id=it.run_id,
                         created_at=_unix(it.created_at) or 0,
                         datasource_item_id=it.datasource_item_id,
                         datasource_item=it.datasource_item, status=it.status,
                         results=it.results, sample=it.sample)


def list_items(session: Session, run: EvalRun, limit: int, after: str | None, order: str,
               status: str | None) -> EvalList[OutputItemOut]:
    """In the data source's order (``datasource_item_id``), or the reverse."""
    q = select(EvalOutputItem).where(EvalOutputItem.run_id == run.id)
    key = EvalOutputItem.datasource_item_id
    if after is not None:
        n = session.scalar(select(key).where(EvalOutputItem.run_id == run.id,
                                             EvalOutputItem.id == after)) \
            if could_be_id(after) else None
        if n is None:
            raise InvalidRequest(f"after: {after!r} is no output item of this run",
                                 param="after")
        q = q.where(key < n if order == "desc" else key > n)
    if status is not None:
        q = q.where(EvalOutputItem.status == status)
    rows = list(session.scalars(q.order_by(key.desc() if order == "desc" else key)
                                .limit(limit + 1)))
    return _list([item_out(r) for r in rows[:limit]], len(rows) > limit)


def find_item(session: Session, run: EvalRun, item_id: str) -> OutputItemOut:
    it = None
    if could_be_id(item_id):
        it = session.scalar(select(EvalOutputItem).where(EvalOutputItem.run_id == run.id,
                                                         EvalOutputItem.id == item_id))
    if it is None:
        raise NotFound(f"no output item {item_id!r} of run {run.id}", param="output_item_id")
    return item_out(it)


def compare_runs(session: Session, ev: Eval, base: EvalRun, candidate: EvalRun, *, seed: int,
                 resamples: int) -> RunComparison:
    """Two runs of ``ev``: per criterion rates, means and paired bootstrap intervals, and
    the items whose verdict flipped (core/evals/compare.py)."""
    names = [c["name"] for c in ev.testing_criteria]
    result = compare(_graded(session, base), _graded(session, candidate), names, seed=seed,
                     resamples=resamples)
    return RunComparison(
        eval_id=ev.id, base_run_id=base.id, candidate_run_id=candidate.id, seed=seed,
        resamples=resamples,
        criteria=[CriterionComparison(
            testing_criteria=c.name, items=c.items, base_pass_rate=c.base_pass_rate,
            candidate_pass_rate=c.candidate_pass_rate,
            pass_rate_difference=c.pass_rate_difference,
            pass_rate_interval=list(c.pass_rate_interval), base_mean_score=c.base_mean_score,
            candidate_mean_score=c.candidate_mean_score,
            mean_score_difference=c.mean_score_difference,
            mean_score_interval=list(c.mean_score_interval)) for c in result.criteria],
        flipped=[FlippedItem(datasource_item_id=f.n, testing_criteria=f.criterion,
                             direction=f.direction,  # type: ignore[arg-type]
                             item=f.item, base_answer=f.base_answer,
                             candidate_answer=f.candidate_answer) for f in result.flipped])


def _graded(session: Session, run: EvalRun) -> dict[int, Graded]:
    out: dict[int, Graded] = {}
    for it in session.scalars(select(EvalOutputItem).where(EvalOutputItem.run_id == run.id)):
        output = (it.sample or {}).get("output") or []
        answer = output[0].get("content") if output else None
        out[it.datasource_item_id] = Graded(it.datasource_item, answer,
                                            {r["name"]: r for r in it.results})
    return out
