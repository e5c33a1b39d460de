"""/v1/files: dataset uploads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api import deps
from api.deps import (
    CurrentTenant,
    FileDep,
    SessionDep,
    SettingsDep,
    TenantThenRelease,
    db_slots,
    get_sessionmaker,
)
from api.errors import error_responses
from api.openai import results_file
from api.schemas import FileDeleted, FileObject, Page
from api.services import files
from core.db.models import Tenant
from core.db.session import unit_of_work
from core.infra.settings import Settings

router = APIRouter(prefix="/v1/files", tags=["files"], responses=error_responses(401))

_MULTIPART_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {
                            "type": "string",
                            "format": "binary",
                            "description": "A .jsonl or .json file (JSON lines or one JSON array "
                            "of objects), optionally gzip-compressed (.jsonl.gz, .json.gz), "
                            "a .csv or a .parquet file.",
                        }
                    },
                }
            }
        },
    }
}


@router.post(
    "",
    status_code=201,
    response_model=FileObject,
    responses=error_responses(413, 422),
    openapi_extra=_MULTIPART_BODY,
)
async def upload_file(
    request: Request, tenant: TenantThenRelease, settings: SettingsDep
) -> FileObject:
    """Upload a dataset; it is streamed to storage, validated and its rows counted."""
    upload = await files.receive_upload(request, settings, tenant)
    async with db_slots(request):
        return await run_in_threadpool(
            _register, get_sessionmaker(request), tenant, upload, settings
        )


def _register(
    maker: sessionmaker[Session], tenant: Tenant, upload: files.ReceivedUpload, settings: Settings
) -> FileObject:
    try:
        with unit_of_work(maker) as session:
            return files.register_upload(session, tenant, upload, settings)
    except BaseException:
        upload.path.unlink(missing_ok=True)  # not recorded: nothing refers to it
        raise


@router.get("", response_model=Page[FileObject], responses=error_responses(422))
def list_files(
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="A file id: list files older than it.")] = None,
    purpose: Annotated[str | None, Query(
        description="fine-tune: the datasets; evals: eval item files. Results files are not "
        "listed: a job's result_files names its own.")] = None,
) -> Page[FileObject]:
    """The tenant's files, newest first."""
    if purpose is not None and purpose not in files.PURPOSES:
        return Page(data=[])
    return files.list_files(session, tenant, limit, after, purpose)


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(404))
def get_file(file_id: Annotated[str, Path()], session: SessionDep,
             tenant: CurrentTenant) -> FileObject:
    """One file: an upload, or a job's results file (OpenAI's result_files)."""
    job = results_file.results_job(session, tenant, file_id)
    if job is not None:
        return results_file.results_file_object(session, job)
    return files.file_object(deps.get_file(file_id, session, tenant))


@router.get("/{file_id}/content", response_class=Response, responses={
    200: {"description": "The bytes as uploaded, or a results file's CSV.",
          "content": {"application/octet-stream": {}, "text/csv": {}}},
    **error_responses(404)})
def get_file_content(file_id: Annotated[str, Path()], session: SessionDep,
                     tenant: CurrentTenant, settings: SettingsDep) -> Response:
    """The file's bytes as uploaded, or a results file's CSV."""
    job = results_file.results_job(session, tenant, file_id)
    if job is not None:
        return Response(results_file.results_content(session, job), media_type="text/csv")
    path = files.stored_path(deps.get_file(file_id, session, tenant), settings)
    return FileResponse(path, media_type="application/octet-stream")


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(404, 409))
def delete_file(
    file: FileDep, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep
) -> FileDeleted:
    """Delete a file and its stored bytes; refused (409) while an unfinished job uses it."""
    return files.delete_file(session, tenant, file, settings)
