"""Request dependencies: settings, DB session, the calling tenant, tenant-owned objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import anyio.to_thread
from fastapi import Depends, Path, Request
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool
from starlette.concurrency import run_in_threadpool

from api.services import keys
from api.services.pagination import could_be_id
from core.db import session as db
from core.db.models import File, Job, Tenant
from core.errors import Forbidden, NotFound, Unauthorized
from core.logging import bind
from core.settings import Settings

Enqueue = Callable[[str], None]


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessionmaker(request: Request) -> sessionmaker[Session]:
    maker: sessionmaker[Session] = request.app.state.sessionmaker
    return maker


def db_slots(request: Request) -> asyncio.Semaphore:
    """How many requests may use the database at once: no more than the engine's pool has
    connections (and the thread pool has threads). A request waits for a slot in the event
    loop, holding nothing; without the limit, requests beyond the pool hold worker threads
    while waiting for a connection, and those holding a connection wait for a thread to run
    their next step: every request stalls until the pool times out."""
    slots: asyncio.Semaphore | None = getattr(request.app.state, "db_slots", None)
    if slots is None:
        threads = int(anyio.to_thread.current_default_thread_limiter().total_tokens)
        slots = asyncio.Semaphore(
            max(1, min(pool_capacity(get_sessionmaker(request)), threads - 8))
        )
        request.app.state.db_slots = slots
    return slots


def pool_capacity(maker: sessionmaker[Session]) -> int:
    pool = getattr(maker.kw.get("bind"), "pool", None)
    if isinstance(pool, QueuePool):
        overflow = pool._max_overflow  # not public; -1 is "no limit"
        return 1_000_000 if overflow < 0 else pool.size() + overflow
    return 1_000_000  # a pool that does not block (NullPool, StaticPool, SingletonThreadPool)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's unit of work: committed when the endpoint returns (then its
    after-commit hooks run, e.g. enqueue), rolled back if it raises. Services never commit."""
    async with db_slots(request):
        session = get_sessionmaker(request)()
        # Read by services that need the operator's settings deep in a read (queue info).
        session.info["settings"] = get_settings(request)
        try:
            yield session
            await run_in_threadpool(db.commit, session)
        except BaseException:
            await run_in_threadpool(db.rollback, session)
            raise
        finally:
            await run_in_threadpool(session.close)


def get_enqueue(request: Request) -> Enqueue | None:
    enqueue: Enqueue | None = request.app.state.enqueue
    return enqueue


SettingsDep = Annotated[Settings, Depends(get_settings)]
# Closed when the endpoint returns, before a streamed body (events, zips) is sent: a stream
# never holds a connection or a slot.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
EnqueueDep = Annotated[Enqueue | None, Depends(get_enqueue)]


def get_current_tenant(request: Request, session: SessionDep) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if not header:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
    tenant = keys.authenticate(session, key.strip())
    # The key's last use is committed at once, not with the request: held until the end of
    # a slow request, its row lock would make the key's other requests wait.
    session.commit()
    bind(tenant_id=tenant.id)
    return tenant


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]


def get_admin(request: Request, session: SessionDep, tenant: CurrentTenant) -> Tenant:
    """The caller, if its key is an admin key (``ftune create-key --admin``); else 403."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    if keys.key_role(session, key) != "admin":
        raise Forbidden("this needs an admin API key (ftune create-key --admin)")
    return tenant


AdminTenant = Annotated[Tenant, Depends(get_admin)]


async def get_tenant_then_release(request: Request) -> Tenant:
    """The caller's tenant, from a session closed at once: for a request that then spends
    long without the database (an upload streaming in holds no connection and no slot)."""
    async with db_slots(request):
        session = get_sessionmaker(request)()
        try:
            return await run_in_threadpool(get_current_tenant, request, session)
        finally:
            await run_in_threadpool(session.close)


TenantThenRelease = Annotated[Tenant, Depends(get_tenant_then_release)]


def get_job(job_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> Job:
    job = None
    if could_be_id(job_id):
        job = session.scalar(select(Job).where(Job.id == job_id, Job.tenant_id == tenant.id))
    if job is None:
        raise NotFound(f"no job {job_id!r}", param="job_id")
    bind(job_id=job.id)
    return job


def get_file(file_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> File:
    file = None
    if could_be_id(file_id):
        file = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if file is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return file


JobDep = Annotated[Job, Depends(get_job)]
FileDep = Annotated[File, Depends(get_file)]
