"""/v1/files: dataset uploads."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool

from api.deps import CurrentTenant, FileDep, SessionDep, SettingsDep
from api.schemas import FileDeleted, FileObject, Page
from api.services import files

router = APIRouter(prefix="/v1/files", tags=["files"])

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
                            "description": "A .jsonl, .json (JSON lines), .csv or .parquet file.",
                        }
                    },
                }
            }
        },
    }
}


@router.post("", status_code=201, response_model=FileObject, openapi_extra=_MULTIPART_BODY)
async def upload_file(
    request: Request, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep
) -> FileObject:
    """Upload a dataset; it is streamed to storage, validated and its rows counted."""
    upload = await files.receive_upload(request, settings, tenant)
    return await run_in_threadpool(files.register_upload, session, tenant, upload, settings)


@router.get("", response_model=Page[FileObject])
def list_files(
    session: SessionDep,
    tenant: CurrentTenant,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="A file id: list files older than it.")] = None,
) -> Page[FileObject]:
    """The tenant's files, newest first."""
    return files.list_files(session, tenant, limit, after)


@router.get("/{file_id}", response_model=FileObject)
def get_file(file: FileDep) -> FileObject:
    """One file."""
    return files.file_object(file)


@router.delete("/{file_id}", response_model=FileDeleted)
def delete_file(
    file: FileDep, session: SessionDep, tenant: CurrentTenant, settings: SettingsDep
) -> FileDeleted:
    """Delete a file and its stored bytes; refused (409) while an unfinished job uses it."""
    return files.delete_file(session, tenant, file, settings)
