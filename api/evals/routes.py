"""/v1/evals: OpenAI's Evals API (the official SDK's client.evals.*), thin over
api/evals/service.py; errors in OpenAI's shape (api/openai/errors.py). The comparison of two
runs (GET /v1/evals/{eval_id}/compare) is ftune's own."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.bodies import MAX_SPEC_BYTES, parse_json_body, read_body
from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.evals import service
from api.evals.schemas import (
    EvalDeleted,
    EvalList,
    EvalOut,
    OutputItemOut,
    RunComparison,
    RunDeleted,
    RunOut,
)
from core.db.models import Eval, EvalRun, Tenant
from core.evals.endpoint import check_model
from core.infra.settings import Settings

router = APIRouter(prefix="/v1/evals", tags=["evals"], responses=error_responses(401))

Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=64)]
Order = Annotated[Literal["asc", "desc"], Query()]
# Bodies of run creates may carry their items (file_content): larger than a spec.
MAX_RUN_BYTES = 32 * MAX_SPEC_BYTES


def get_eval(eval_id: Annotated[str, Path()], session: SessionDep,
             tenant: CurrentTenant) -> Eval:
    return service.find_eval(session, tenant, eval_id)


EvalDep = Annotated[Eval, Depends(get_eval)]


def get_run(run_id: Annotated[str, Path()], ev: EvalDep, session: SessionDep) -> EvalRun:
    return service.find_run(session, ev, run_id)


RunDep = Annotated[EvalRun, Depends(get_run)]


def _base_url(request: Request) -> str:
    return str(request.base_url)


def _enqueue(request: Request) -> service.EnqueueRun:
    """The app's sender of eval runs (tests put their own in app.state.eval_enqueue)."""
    enqueue: service.EnqueueRun | None = getattr(request.app.state, "eval_enqueue", None)
    if enqueue is None:
        from core.evals.dispatch import enqueue_run

        enqueue = enqueue_run
    return enqueue


@router.post("", response_model=EvalOut, responses=error_responses(400, 413))
async def create_eval(request: Request, session: SessionDep, tenant: CurrentTenant,
                      settings: SettingsDep) -> EvalOut:
    """client.evals.create: an item schema and the testing criteria runs grade with."""
    body = parse_json_body(await read_body(request, MAX_SPEC_BYTES))
    return await run_in_threadpool(service.create_eval, session, tenant, body, settings)


@router.get("", response_model=EvalList[EvalOut], responses=error_responses(400))
def list_evals(session: SessionDep, tenant: CurrentTenant, limit: Limit = 20,
               after: After = None, order: Order = "asc",
               order_by: Annotated[Literal["created_at", "updated_at"], Query()] = "created_at",
               ) -> EvalList[EvalOut]:
    """The tenant's evals by creation time (updated_at orders as created_at: an update
    changes only the name and metadata)."""
    return service.list_evals(session, tenant, limit, after, order)


@router.get("/{eval_id}", response_model=EvalOut, responses=error_responses(404))
def retrieve_eval(ev: EvalDep) -> EvalOut:
    return service.eval_out(ev)


@router.post("/{eval_id}", response_model=EvalOut, responses=error_responses(400, 404))
async def update_eval(request: Request, ev: EvalDep, session: SessionDep) -> EvalOut:
    """client.evals.update: the name and metadata."""
    body = parse_json_body(await read_body(request, MAX_SPEC_BYTES))
    return await run_in_threadpool(service.update_eval, session, ev, body)


@router.delete("/{eval_id}", response_model=EvalDeleted, responses=error_responses(404, 409))
def delete_eval(ev: EvalDep, session: SessionDep) -> EvalDeleted:
    """The eval with its runs and output items; refused while a run has not finished."""
    return service.delete_eval(session, ev)


# --------------------------------------------------------------------------- runs


def _run_create(session: Session, tenant: Tenant, ev: Eval, body: object, settings: Settings,
                enqueue: service.EnqueueRun, base_url: str) -> RunOut:
    def model_check(model: str) -> None:
        check_model(session, tenant, model, settings)

    return service.create_run(session, tenant, ev, body, settings, model_check, enqueue,
                              base_url)


@router.post("/{eval_id}/runs", response_model=RunOut,
             responses=error_responses(400, 404, 413))
async def create_run(request: Request, ev: EvalDep, session: SessionDep, tenant: CurrentTenant,
                     settings: SettingsDep) -> RunOut:
    """client.evals.runs.create: checked (model, templates, rows against the item schema),
    then queued for a worker."""
    body = parse_json_body(await read_body(request, MAX_RUN_BYTES))
    return await run_in_threadpool(_run_create, session, tenant, ev, body, settings,
                                   _enqueue(request), _base_url(request))


@router.get("/{eval_id}/runs", response_model=EvalList[RunOut], responses=error_responses(400))
def list_runs(request: Request, ev: EvalDep, session: SessionDep, limit: Limit = 20,
              after: After = None, order: Order = "asc",
              status: Annotated[str | None, Query(max_length=16)] = None) -> EvalList[RunOut]:
    return service.list_runs(session, ev, limit, after, order, status, _base_url(request))


@router.get("/{eval_id}/runs/{run_id}", response_model=RunOut, responses=error_responses(404))
def retrieve_run(request: Request, run: RunDep, session: SessionDep) -> RunOut:
    """The run; while it runs, its counts so far."""
    return service.run_out(session, run, _base_url(request))


@router.post("/{eval_id}/runs/{run_id}/cancel", response_model=RunOut,
             responses=error_responses(404))
def cancel_run(request: Request, run: RunDep, session: SessionDep) -> RunOut:
    """Queued: canceled now. Running: canceling until its worker stops (its next
    heartbeat); the items graded so far are kept."""
    return service.cancel_run(session, run, _base_url(request))


@router.delete("/{eval_id}/runs/{run_id}", response_model=RunDeleted,
               responses=error_responses(404, 409))
def delete_run(run: RunDep, session: SessionDep) -> RunDeleted:
    return service.delete_run(session, run)


@router.get("/{eval_id}/runs/{run_id}/output_items", response_model=EvalList[OutputItemOut],
            responses=error_responses(400, 404))
def list_output_items(run: RunDep, session: SessionDep, limit: Limit = 20,
                      after: After = None, order: Order = "asc",
                      status: Annotated[Literal["pass", "fail", "error"] | None, Query()] = None,
                      ) -> EvalList[OutputItemOut]:
    return service.list_items(session, run, limit, after, order, status)


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}",
            response_model=OutputItemOut, responses=error_responses(404))
def retrieve_output_item(output_item_id: Annotated[str, Path()], run: RunDep,
                         session: SessionDep) -> OutputItemOut:
    return service.find_item(session, run, output_item_id)


@router.get("/{eval_id}/compare", response_model=RunComparison,
            responses=error_responses(400, 404))
def compare_runs(ev: EvalDep, session: SessionDep,
                 base_run_id: Annotated[str, Query(max_length=64)],
                 candidate_run_id: Annotated[str, Query(max_length=64)],
                 seed: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
                 resamples: Annotated[int, Query(ge=100, le=20_000)] = 2000) -> RunComparison:
    """ftune: two runs of this eval side by side (base, then candidate): per criterion pass
    rates and mean scores, the difference with a paired bootstrap 95% interval (seeded),
    and the items whose verdict flipped, with both answers."""
    base = service.find_run(session, ev, base_run_id)
    candidate = service.find_run(session, ev, candidate_run_id)
    return service.compare_runs(session, ev, base, candidate, seed=seed, resamples=resamples)
