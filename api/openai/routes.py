"""OpenAI's fine-tuning routes (/v1/fine_tuning/jobs...) and models (/v1/models): thin, over
api/openai/service.py and api/openai/model_lookup.py. Errors here are OpenAI's shape
(api/openai/errors.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from api.bodies import MAX_SPEC_BYTES, parse_json_body, read_body
from api.deps import CurrentTenant, EnqueueDep, SessionDep, SettingsDep
from api.errors import error_responses
from api.openai import model_lookup, service
from api.openai.schemas import FineTuningJob, JobCheckpoint, JobEvent, ListOf, ModelOut
from core.db.models import Job

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["openai"],
                   responses=error_responses(401))
models = APIRouter(prefix="/v1/models", tags=["openai"], responses=error_responses(401))

Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=64)]


def get_job(fine_tuning_job_id: Annotated[str, Path()], session: SessionDep,
            tenant: CurrentTenant) -> Job:
    return service.find_job(session, tenant, fine_tuning_job_id)


JobDep = Annotated[Job, Depends(get_job)]


@router.post("", response_model=FineTuningJob, responses=error_responses(400, 413, 429),
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": {"$ref": "#/components/schemas/JobCreate"}}}}})
async def create_job(request: Request, session: SessionDep, tenant: CurrentTenant,
                     settings: SettingsDep, enqueue: EnqueueDep) -> FineTuningJob:
    """client.fine_tuning.jobs.create: an OpenAI-style job, run as a JobSpec."""
    body = parse_json_body(await read_body(request, MAX_SPEC_BYTES))
    return await run_in_threadpool(service.create_job, session, tenant, body,
                                   settings=settings, enqueue=enqueue)


@router.get("", response_model=ListOf[FineTuningJob], responses=error_responses(400))
def list_jobs(request: Request, session: SessionDep, tenant: CurrentTenant,
              settings: SettingsDep, limit: Limit = 20,
              after: After = None) -> ListOf[FineTuningJob]:
    """Newest first; ``metadata[key]=value`` query parameters filter."""
    wanted = {k[len("metadata["):-1]: v for k, v in request.query_params.items()
              if k.startswith("metadata[") and k.endswith("]")}
    return service.list_jobs(session, tenant, settings, limit, after, wanted)


@router.get("/{fine_tuning_job_id}", response_model=FineTuningJob,
            responses=error_responses(404))
def retrieve_job(job: JobDep, session: SessionDep, tenant: CurrentTenant,
                 settings: SettingsDep) -> FineTuningJob:
    return service.to_openai(session, tenant, job, settings)


@router.post("/{fine_tuning_job_id}/cancel", response_model=FineTuningJob,
             responses=error_responses(404))
def cancel_job(job: JobDep, session: SessionDep, tenant: CurrentTenant,
               settings: SettingsDep) -> FineTuningJob:
    return service.cancel(session, tenant, job, settings)


@router.post("/{fine_tuning_job_id}/pause", response_model=FineTuningJob,
             responses=error_responses(404, 409))
def pause_job(job: JobDep, session: SessionDep, tenant: CurrentTenant,
              settings: SettingsDep) -> FineTuningJob:
    return service.pause(session, tenant, job, settings)


@router.post("/{fine_tuning_job_id}/resume", response_model=FineTuningJob,
             responses=error_responses(404, 409))
def resume_job(job: JobDep, session: SessionDep, tenant: CurrentTenant,
               settings: SettingsDep, enqueue: EnqueueDep) -> FineTuningJob:
    return service.resume(session, tenant, job, settings, enqueue)


@router.get("/{fine_tuning_job_id}/events", response_model=ListOf[JobEvent],
            responses=error_responses(400, 404))
def list_events(job: JobDep, session: SessionDep, limit: Limit = 20,
                after: After = None) -> ListOf[JobEvent]:
    return service.list_events(session, job, limit, after)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=ListOf[JobCheckpoint],
            responses=error_responses(400, 404))
def list_checkpoints(job: JobDep, session: SessionDep, tenant: CurrentTenant,
                     settings: SettingsDep, limit: Limit = 10,
                     after: After = None) -> ListOf[JobCheckpoint]:
    return service.list_checkpoints(session, tenant, job, settings, limit, after)


@models.get("", response_model=ListOf[ModelOut])
def list_models(session: SessionDep, tenant: CurrentTenant,
                settings: SettingsDep) -> ListOf[ModelOut]:
    """The catalog's base models and this tenant's fine-tuned (``ft:``) models."""
    return model_lookup.list_models(session, tenant, settings)


@models.get("/{model}", response_model=ModelOut, responses=error_responses(404))
def retrieve_model(model: str, session: SessionDep, tenant: CurrentTenant,
                   settings: SettingsDep) -> ModelOut:
    return model_lookup.get_model(session, tenant, settings, model)


