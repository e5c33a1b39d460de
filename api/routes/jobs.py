"""/v1/jobs: submit, read, cancel, pause, resume, and what a run produced."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Path, Query, Request, Response
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.sse import EventSourceResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.bodies import MAX_SPEC_BYTES, parse_json_body, read_body
from api.deps import (
    CurrentTenant,
    EnqueueDep,
    JobDep,
    Reader,
    ReaderDep,
    SessionDep,
    SettingsDep,
    db_slots,
    get_sessionmaker,
    job_not_found,
    tenant_job,
)
from api.errors import error_responses
from api.schemas import (
    CheckpointObject,
    EstimateObject,
    EventObject,
    JobObject,
    LaunchInfo,
    LogLines,
    ModelFiles,
    Page,
    ResumeRequest,
)
from api.services import artifacts, estimates, jobs, resize
from api.services.event_stream import event_stream
from api.services.pagination import could_be_id
from core.db.models import JobStatus, Tenant
from core.infra.logging import bind

log = logging.getLogger("ftune.api")

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=error_responses(401))

# The database's integer columns: a larger number names nothing (and PostgreSQL refuses it).
MAX_INT = 2**31 - 1
MAX_BIGINT = 2**63 - 1


@router.post(
    "",
    status_code=201,
    response_model=JobObject,
    responses={
        200: {
            "model": JobObject | EstimateObject,
            "description": "Replay of an Idempotency-Key (a job), or a dry run (an estimate).",
        },
        **error_responses(409, 413, 422, 429),
    },
)
async def create_job(
    request: Request,
    response: Response,
    session: SessionDep,
    tenant: CurrentTenant,
    settings: SettingsDep,
    enqueue: EnqueueDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
    dry_run: Annotated[
        bool,
        Query(
            description="Check the spec as a submit does, record nothing, and answer 200 with "
            "an estimate: exact tokens and steps, memory per process, expected time and cost."
        ),
    ] = False,
    preview: Annotated[
        int,
        Query(
            ge=0,
            le=20,
            description="With dry_run: also return the first N training rows as the trainer "
            "renders them, token by token, the tokens that carry loss marked.",
        ),
    ] = 3,
) -> Any:
    """Validate a job spec (every problem in one 422) and queue the job. The body is a
    JobSpec (see its schema), read whatever the content type (curl -d sends a form type)."""
    body = parse_json_body(await read_body(request, MAX_SPEC_BYTES))
    if dry_run:
        estimate = await run_in_threadpool(
            estimates.dry_run, session, tenant, body, settings=settings, preview=preview
        )
        return JSONResponse(estimate.model_dump(mode="json"))
    job, created = await run_in_threadpool(
        jobs.submit_job,
        session,
        tenant,
        body,
        settings=settings,
        idempotency_key=idempotency_key,
        enqueue=enqueue,
    )
    if not created:
        response.status_code = 200
        response.headers["Idempotent-Replayed"] = "true"
    return await run_in_threadpool(jobs.get_job_object, session, job, settings)


JobId = Annotated[str, Path()]


@router.get("", response_model=Page[JobObject], responses=error_responses(422))
async def list_jobs(
    tenant: CurrentTenant,
    read: ReaderDep,
    status: Annotated[JobStatus | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="A job id: list jobs older than it.")] = None,
) -> Page[JobObject]:
    """The tenant's jobs, newest first."""
    return await read(jobs.list_jobs, tenant, status, limit, after, read.settings)


async def get_job(job_id: JobId, tenant: CurrentTenant, read: ReaderDep) -> Response:
    """One job: status, progress, latest metrics, usage, and the spec that runs."""
    response = await read_job(read, tenant, job_id)
    if response is None:
        raise job_not_found(job_id)
    return response


async def read_job(read: Reader, tenant: Tenant, job_id: str) -> Response | None:
    """GET /v1/jobs/{id}'s answer, or None if the tenant has no such job: the body kept
    from the last read if the database has not changed since (api/readcache.py), else the
    job read. For the route and for ``ServePolledJobs``, which answers before the routing."""
    if not could_be_id(job_id):
        return None
    response = await read.json((tenant.id, job_id), jobs.shows_own_rows_only,
                               jobs.read_job_object, tenant.id, job_id, read.settings)
    if response is not None:
        bind(job_id=job_id)
    return response


POLLED_JOB_PATH = "/v1/jobs/{job_id}"


def add_polled_routes(app: FastAPI) -> None:
    """GET /v1/jobs/{id}, what dashboards poll, on the app itself rather than in ``router``:
    FastAPI matches the routes of an included router twice (once to pick the router, once
    in it), which cost 7 % of this route's CPU. Added after the probes, before the routers.
    Most of its requests are answered before the routing (``ServePolledJobs``,
    api/middleware/polled_jobs.py)."""
    app.add_api_route(POLLED_JOB_PATH, get_job, methods=["GET"], tags=["jobs"],
                      response_model=JobObject, responses=error_responses(401, 404))


@router.post("/{job_id}/cancel", response_model=JobObject, responses=error_responses(404))
def cancel_job(job: JobDep, session: SessionDep, settings: SettingsDep) -> JobObject:
    """Cancel (idempotent): a queued job at once, a running one through its worker."""
    return jobs.get_job_object(session, jobs.cancel_job(session, job), settings)


@router.post("/{job_id}/pause", response_model=JobObject, responses=error_responses(404, 409))
def pause_job(job: JobDep, session: SessionDep, settings: SettingsDep) -> JobObject:
    """Pause (idempotent): a queued job at once; a running one is stopped by its worker at a
    checkpoint (status pausing), then releases its GPUs (paused)."""
    return jobs.get_job_object(session, jobs.pause_job(session, job), settings)


@router.post("/{job_id}/resume", response_model=JobObject,
             responses=error_responses(400, 404, 409, 422))
def resume_job(job: JobDep, session: SessionDep, enqueue: EnqueueDep,
               settings: SettingsDep, body: ResumeRequest | None = None) -> JobObject:
    """Resume a paused job (idempotent): it is queued again and continues from the
    checkpoint it paused at, on any worker; with `num_processes` (and `strategy`) on
    another number of processes, keeping the checkpoint's global batch."""
    if body is not None:
        resize.resize_paused(session, job, body, settings)
    return jobs.get_job_object(session, jobs.resume_job(session, job, enqueue), settings)


@router.get(
    "/{job_id}/events",
    response_model=Page[EventObject],
    responses={200: {"content": {"text/event-stream": {}}}, **error_responses(404, 422)},
)
async def list_events(
    request: Request,
    job_id: JobId,
    tenant: CurrentTenant,
    read: ReaderDep,
    after: Annotated[int | None, Query(ge=0, le=MAX_BIGINT, description="An event id.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    last_event_id: Annotated[str | None, Header()] = None,
) -> Any:
    """Events, oldest first. With `Accept: text/event-stream` they stream live until the
    job has finished (resume with `Last-Event-ID`)."""
    if "text/event-stream" in request.headers.get("accept", ""):
        job = await read(tenant_job, tenant, job_id)
        start = after
        if last_event_id and last_event_id.strip().isdigit():
            start = int(last_event_id.strip())
        stream = event_stream(get_sessionmaker(request), db_slots(request), job.id, start)
        # Returned, not `response_class=EventSourceResponse` on a generator: one URL serves
        # both the JSON page and the stream, chosen by Accept. FastAPI's format_sse_event
        # frames each event.
        return EventSourceResponse(
            stream, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
    return await read(_events_page, tenant, job_id, after, limit)


def _events_page(
    session: Session, tenant: Tenant, job_id: str, after: int | None, limit: int
) -> Page[EventObject]:
    return jobs.list_events(session, tenant_job(session, tenant, job_id), after, limit)


@router.get(
    "/{job_id}/checkpoints", response_model=Page[CheckpointObject], responses=error_responses(404)
)
def list_checkpoints(job: JobDep, session: SessionDep) -> Page[CheckpointObject]:
    """Saved checkpoints, by step, with the metrics at that step."""
    return jobs.list_checkpoints(session, job)


@router.get("/{job_id}/logs", response_model=LogLines, responses=error_responses(404, 422))
def get_logs(job: JobDep, tail: Annotated[int, Query(ge=1, le=10_000)] = 200) -> LogLines:
    """The last lines of the trainer's output (every rank)."""
    return LogLines(lines=artifacts.tail_log(job, tail))


@router.get("/{job_id}/launch", response_model=LaunchInfo, responses=error_responses(404))
def get_launch(job: JobDep) -> LaunchInfo:
    """The accelerate config and argv the worker ran, to reproduce the run by hand."""
    return artifacts.launch_info(job)


@router.get(
    "/{job_id}/adapter",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/zip": {}}}, **error_responses(404, 409, 422)},
)
def download_adapter(
    job: JobDep,
    session: SessionDep,
    checkpoint: Annotated[
        int | None, Query(ge=0, le=MAX_INT, description="A checkpoint's step.")
    ] = None,
) -> StreamingResponse:
    """The trained adapter (or a checkpoint's adapter) as a zip."""
    name, files = artifacts.adapter_files(session, job, checkpoint)
    return StreamingResponse(
        artifacts.stream_zip(files),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{name}.zip"'},
    )


@router.get("/{job_id}/model", response_model=ModelFiles,
            responses=error_responses(404, 409, 422))
def list_model_files(
    job: JobDep,
    session: SessionDep,
    checkpoint: Annotated[
        int | None, Query(ge=0, le=MAX_INT, description="A checkpoint's step.")
    ] = None,
) -> ModelFiles:
    """The files of a fully fine-tuned model (peft method full), or of one of its
    checkpoints, with sizes and sha256; GET each file's url to download it."""
    return artifacts.model_files(session, job, checkpoint)


@router.get(
    "/{job_id}/model/{name}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}},
               206: {"description": "Part of the file (a Range request)"},
               416: {"description": "The Range starts beyond the end of the file"},
               **error_responses(404, 409, 422)},
)
def download_model_file(
    job: JobDep,
    session: SessionDep,
    name: Annotated[str, Path(max_length=255, description="A file of the listing.")],
    checkpoint: Annotated[
        int | None, Query(ge=0, le=MAX_INT, description="A checkpoint's step.")
    ] = None,
) -> FileResponse:
    """One file of the model (or of a checkpoint's), streamed from disk; HTTP Range
    requests get 206 (resume a download), a range beyond the end 416."""
    return FileResponse(artifacts.model_file(session, job, name, checkpoint), filename=name,
                        media_type="application/octet-stream")


@router.get(
    "/{job_id}/tensorboard",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/zip": {}}}, **error_responses(404, 409)},
)
def download_tensorboard(job: JobDep) -> StreamingResponse:
    """The job's TensorBoard event files as a zip (also while it runs)."""
    files = artifacts.tensorboard_files(job)
    return StreamingResponse(
        artifacts.stream_zip(files),
        media_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="{job.id}-tensorboard.zip"'},
    )
