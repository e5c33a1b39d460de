"""Request dependencies: settings, DB session, the calling tenant, tenant-owned objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.services import keys
from core.db.models import File, Job, Tenant
from core.errors import NotFound, Unauthorized
from core.settings import Settings

Enqueue = Callable[[str], None]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    maker: sessionmaker[Session] = request.app.state.sessionmaker
    return maker


def get_session(request: Request) -> Iterator[Session]:
    session = get_sessionmaker(request)()
    try:
        yield session
    finally:
        session.close()


def get_enqueue(request: Request) -> Enqueue | None:
    enqueue: Enqueue | None = request.app.state.enqueue
    return enqueue


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
EnqueueDep = Annotated[Enqueue | None, Depends(get_enqueue)]


def get_current_tenant(request: Request, session: SessionDep) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
    return keys.authenticate(session, key.strip())


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]


def get_job(job_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> Job:
    job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))
    if job is None:
        raise NotFound(f"no job {job_id!r}", param="job_id")
    return job


def get_file(file_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> File:
    file = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if file is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return file


JobDep = Annotated[Job, Depends(get_job)]
FileDep = Annotated[File, Depends(get_file)]
