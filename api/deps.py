"""Request dependencies: settings, DB session, the calling tenant, tenant-owned objects."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, Concatenate, ParamSpec, TypeVar

import anyio.to_thread
from fastapi import Depends, Path, Request, Response
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import State

from api.readcache import ReadCache
from api.services import jobs, keys
from api.services.pagination import could_be_id
from core.db import session as db
from core.db.models import File, Job, Tenant
from core.db.session import LoopReads, is_lock_timeout
from core.infra.errors import Forbidden, NotFound, Unauthorized
from core.infra.logging import bind
from core.infra.settings import Settings

Enqueue = Callable[[str], None]
P = ParamSpec("P")
log = logging.getLogger("ftune.api")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


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


@asynccontextmanager
async def request_db_slot(request: Request) -> AsyncIterator[None]:
    """The request's slot, taken once however many of its dependencies ask: a request that
    waited for a second slot while holding one would deadlock with others doing the same."""
    # A key of the ASGI scope, not request.state: a name missing from a starlette State
    # costs a KeyError and an AttributeError, on every request.
    scope = request.scope
    if scope.get(HOLDS_DB_SLOT):
        yield
        return
    async with db_slots(request):
        scope[HOLDS_DB_SLOT] = True
        try:
            yield
        finally:
            scope[HOLDS_DB_SLOT] = False


HOLDS_DB_SLOT = "ftune.holds_db_slot"


def pool_capacity(maker: sessionmaker[Session]) -> int:
    pool = getattr(maker.kw.get("bind"), "pool", None)
    if isinstance(pool, QueuePool):
        overflow = pool._max_overflow  # not public; -1 is "no limit"
        return 1_000_000 if overflow < 0 else pool.size() + overflow
    return 1_000_000  # a pool that does not block (NullPool, StaticPool, SingletonThreadPool)


# Requests that only read: their session is closed without a commit, so they never write.
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's unit of work: committed when the endpoint returns (then its
    after-commit hooks run, e.g. enqueue), rolled back if it raises or only reads. Services
    never commit. Ending it is one trip to the thread pool, not one per step: each trip
    hands the GIL between the event loop and a worker thread, which under load costs more
    than the queries."""
    async with request_db_slot(request):
        session = get_sessionmaker(request)()
        # Read by services that need the operator's settings deep in a read (queue info).
        session.info["settings"] = get_settings(request)
        try:
            yield session
        except BaseException:
            await run_in_threadpool(_end, session, False)
            raise
        await run_in_threadpool(_end, session, request.method not in READ_METHODS)


def _end(session: Session, commit: bool) -> None:
    try:
        if commit:
            db.commit(session)
        else:
            db.rollback(session)
    except BaseException:
        db.rollback(session)
        raise
    finally:
        session.close()


# Dependencies that only read app state are `async def`: FastAPI runs a sync dependency in
# the thread pool, and that trip (a GIL handoff each way) cost more than a request's query.
async def settings_dep(request: Request) -> Settings:
    return get_settings(request)


async def enqueue_dep(request: Request) -> Enqueue | None:
    enqueue: Enqueue | None = request.app.state.enqueue
    return enqueue


SettingsDep = Annotated[Settings, Depends(settings_dep)]
# Closed when the endpoint returns, before a streamed body (events, zips) is sent: a stream
# never holds a connection or a slot.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
EnqueueDep = Annotated[Enqueue | None, Depends(enqueue_dep)]


def key_cache(request: Request) -> keys.KeyCache:
    return app_key_cache(request.app.state)


def app_key_cache(state: State) -> keys.KeyCache:
    cache: keys.KeyCache | None = getattr(state, "key_cache", None)
    if cache is None:
        cache = keys.KeyCache(ttl=state.settings.api_key_cache_seconds)
        state.key_cache = cache
    return cache


def bearer_key(authorization: str) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None if it is not one."""
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def trusted_tenant(state: State, key: str) -> Tenant | None:
    """The key's tenant if the key cache holds it and no refresh is due: what a request
    answered outside the routes (ServePolledJobs, api/middleware/polled_jobs.py) may act
    for. Else None, and the request goes to its route, whose ``get_current_tenant``
    verifies the key."""
    tenant, refresh_due = app_key_cache(state).lookup(keys.hash_key(key))
    return None if refresh_due else tenant


def key_checks(request: Request) -> dict[str, asyncio.Task[Tenant]]:
    """Key verifications in flight, by key hash (``_verify_once``)."""
    pending: dict[str, asyncio.Task[Tenant]] | None = getattr(
        request.app.state, "key_checks", None
    )
    if pending is None:
        pending = request.app.state.key_checks = {}
    return pending


async def get_current_tenant(request: Request) -> Tenant:
    """The caller's tenant. A key verified in the last ``api_key_cache_seconds`` is taken
    from memory (no thread, no database); otherwise it is checked in a session of its own,
    closed at once, so a request that then spends long without the database (an upload
    streaming in) holds no connection and no slot."""
    header = request.headers.get("authorization", "")
    if not header:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    key = bearer_key(header)
    if key is None:
        raise Unauthorized("malformed Authorization header: expected 'Bearer <key>'")
    key_hash = keys.hash_key(key)
    cache = key_cache(request)
    tenant, refresh_due = cache.lookup(key_hash)
    if tenant is None:
        tenant = await _verify_once(request, cache, key_hash, key)
    elif refresh_due:  # verified again beside the requests, which do not wait for it
        _start_verify(request, cache, key_hash, key)
    bind(tenant_id=tenant.id)
    return tenant


async def _verify_once(request: Request, cache: keys.KeyCache, key_hash: str,
                       key: str) -> Tenant:
    """Verify a key that is not in the cache, once however many requests ask at the same
    time. A dashboard's key expires from the cache in the middle of its load: every request
    in flight then missed it together, and each verified it on its own (a thread, a
    connection, a query; measured: requests stalled 0.5 s at 100 connections). The first
    starts a task; the others await it. The task is shielded: a client that hangs up does
    not cancel the others' verification.

    The task takes no DB slot: the request that started it may already hold one (a route
    with a session), and the others may not; one check per key in flight is bounded, and
    the slots leave threads spare for it (``db_slots``)."""
    return await asyncio.shield(_start_verify(request, cache, key_hash, key))


def _start_verify(request: Request, cache: keys.KeyCache, key_hash: str,
                  key: str) -> asyncio.Task[Tenant]:
    """The key's verification in flight, started if none is. A refused key leaves the
    cache (a refresh finding the key revoked ends its entry at once)."""
    pending = key_checks(request)
    task = pending.get(key_hash)
    if task is None:
        maker = get_sessionmaker(request)

        async def verify() -> Tenant:
            try:
                tenant, record = await run_in_threadpool(_authenticate, maker, key)
                cache.put(key_hash, tenant)
            except BaseException:
                cache.drop(key_hash)
                raise
            finally:
                pending.pop(key_hash, None)
            if record is not None:
                _record_use_later(request, maker, record)
            return tenant

        task = asyncio.ensure_future(verify())
        # A refresh nobody awaits: its error (a revoked key, the database away) is seen by
        # the next request that verifies; retrieving it here keeps asyncio from logging it.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        pending[key_hash] = task
    return task


def _authenticate(maker: sessionmaker[Session], key: str) -> tuple[Tenant, str | None]:
    with maker() as session:  # only reads; closing rolls back
        tenant, record = keys.authenticate(session, key)
        session.expunge(tenant)  # shared by requests from now on: loaded, never refreshed
    return tenant, record


def _record_use_later(request: Request, maker: sessionmaker[Session], key_id: str) -> None:
    """The key's last use (once a minute), written where no request waits for it: on SQLite
    a write queues behind the worker's, and requests that waited for a verification with
    this write in it stalled with it while a job started."""
    writes: set[asyncio.Task[None]] | None = getattr(request.app.state, "key_use_writes", None)
    if writes is None:
        writes = request.app.state.key_use_writes = set()
    task = asyncio.ensure_future(run_in_threadpool(_record_use, maker, key_id))
    writes.add(task)  # held until done: the loop keeps only weak references to tasks
    task.add_done_callback(writes.discard)


def _record_use(maker: sessionmaker[Session], key_id: str) -> None:
    try:
        with db.unit_of_work(maker) as session:
            keys.record_use(session, key_id)
    except Exception:  # a lost last-use stamp is retried at the next verification
        log.warning("recording an API key's last use failed", exc_info=True)


CurrentTenant = Annotated[Tenant, Depends(get_current_tenant)]
# The same: authentication never holds a connection past itself.
TenantThenRelease = CurrentTenant


def get_admin(request: Request, session: SessionDep, tenant: CurrentTenant) -> Tenant:
    """The caller, if its key is an admin key (``ftune create-key --admin``); else 403."""
    key = request.headers.get("authorization", "").partition(" ")[2].strip()
    if keys.key_role(session, key) != "admin":
        raise Forbidden("this needs an admin API key (ftune create-key --admin)")
    return tenant


AdminTenant = Annotated[Tenant, Depends(get_admin)]


def tenant_job(session: Session, tenant: Tenant, job_id: str) -> Job:
    """The tenant's job ``job_id``, or 404 (another tenant's job does not exist for it)."""
    job = jobs.find_tenant_job(session, tenant.id, job_id) if could_be_id(job_id) else None
    if job is None:
        raise job_not_found(job_id)
    bind(job_id=job.id)
    return job


def job_not_found(job_id: str) -> NotFound:
    return NotFound(f"no job {job_id!r}", param="job_id")


def get_job(job_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> Job:
    return tenant_job(session, tenant, job_id)


def get_file(file_id: Annotated[str, Path()], session: SessionDep, tenant: CurrentTenant) -> File:
    file = None
    if could_be_id(file_id):
        file = session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant.id))
    if file is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return file


JobDep = Annotated[Job, Depends(get_job)]


class Reader:
    """Runs a read-only use case ``fn(session, *args)`` on a session opened and closed (never
    committed) around it. The hot read endpoints (job, list, events) use it instead of a
    SessionDep and sync dependencies, which cost a trip to the thread pool each: every trip
    hands the GIL between the event loop and a worker thread, and under load the handoffs,
    not the queries, set the rate.

    On a SQLite file the read runs on the event loop itself, on the loop's own read-only
    connection (core/db/session.py LoopReads): no trip at all. Measured in process on
    GET /v1/jobs/{id}, 50 in flight: 0.27 ms CPU a request against 0.39 ms in a thread. A read that meets a lock gives up after a few milliseconds and goes to a
    thread, where it may wait as long as any other. Elsewhere (PostgreSQL: a read waits on
    a socket) it takes one trip to the read threads."""

    def __init__(self, request: Request) -> None:
        self.request = request
        # For the reads that need the operator's settings: one dependency fewer to solve.
        self.settings = get_settings(request)

    async def __call__(
        self, fn: Callable[Concatenate[Session, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        loop_reads: LoopReads | None = self.request.app.state.loop_reads
        if loop_reads is not None:
            try:
                return loop_reads.run(fn, *args, **kwargs)
            except OperationalError as exc:
                if not is_lock_timeout(exc):
                    raise
                log.info("a read on the event loop met a lock; reading in a thread")
        read_maker = getattr(self.request.app.state, "read_sessionmaker", None)
        if read_maker is not None:
            # The read engine's pool has a connection for each read thread
            # (core/db/session.py make_read_engine): a read there waits for a thread, never
            # for a connection, and takes no slot (an asyncio semaphore and a context
            # manager: 2 % of GET job's CPU).
            return await self._in_thread(read_maker, fn, *args, **kwargs)
        async with request_db_slot(self.request):
            return await self._in_thread(get_sessionmaker(self.request), fn, *args, **kwargs)

    async def json(
        self, key: tuple[str, str], own_rows_only: Callable[[M], bool],
        fn: Callable[Concatenate[Session, P], M | None], *args: P.args, **kwargs: P.kwargs,
    ) -> Response | None:
        """``fn``'s model as a JSON response, read as ``__call__`` reads, or the body sent
        for ``key`` (tenant id, job id) before if the database has not changed since
        (api/readcache.py; ``own_rows_only(model)``: the model shows the job's own rows
        alone); None if ``fn`` found nothing (not kept). The body is the model's own
        serialisation, also on a miss: FastAPI's validation of a returned model against
        the route's response model, then its encoding, cost more than the read."""
        cache: ReadCache | None = self.request.app.state.read_cache
        version = None
        if cache is not None:
            version = cache.version(key[1])  # before the read: see ReadCache.put
            body = cache.get(key, version)
            if body is not None:
                return Response(body, media_type="application/json")
        model = await self(fn, *args, **kwargs)
        if model is None:
            return None
        body = model.__pydantic_serializer__.to_json(model)  # bytes, as model_dump_json's
        if cache is not None and version is not None:
            cache.put(key, version, body, own_rows_only(model))
        return Response(body, media_type="application/json")

    async def _in_thread(self, maker: sessionmaker[Session], fn: Callable[..., T],
                         *args: Any, **kwargs: Any) -> T:
        read = partial(_read, maker, fn, *args, **kwargs)
        # The request's context goes along (log fields bound in the read reach its line).
        return await asyncio.get_running_loop().run_in_executor(
            read_executor(self.request), contextvars.copy_context().run, read
        )


# Threads of the hot reads. Few: the reads are short and mostly Python (SQLAlchemy, the
# response object) under one GIL, and more threads only take turns at it. Measured in process
# on GET /v1/jobs/{id} at 50 requests in flight: 4 threads 0.92-1.00 ms CPU a request, 15
# threads 1.10-1.13 ms. Against PostgreSQL, 4 reads waiting on the network at once still
# outrun what one process can serialise.
READ_THREADS = 4


def read_executor(request: Request) -> ThreadPoolExecutor:
    """The threads of the hot reads: asyncio's executor, not anyio's thread pool, whose trip
    (capacity limiter, cancel scope, its own wake-up) cost more CPU than the job's query.
    Shut down with the app (api/main.py)."""
    executor: ThreadPoolExecutor | None = getattr(request.app.state, "read_executor", None)
    if executor is None:
        executor = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ftune-read")
        request.app.state.read_executor = executor
    return executor


def _read(maker: sessionmaker[Session], fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    try:
        with maker() as session:  # closing rolls back: a read never commits
            return fn(session, *args, **kwargs)
    except DBAPIError as exc:
        # The read engine pings no connection before use (core/db/session.py
        # make_read_engine): one the server closed is found here, the pool has dropped it,
        # and the read (no effect to repeat) runs once more on a fresh connection.
        if not exc.connection_invalidated:
            raise
    with maker() as session:
        return fn(session, *args, **kwargs)


async def reader_dep(request: Request) -> Reader:
    return Reader(request)


ReaderDep = Annotated[Reader, Depends(reader_dep)]
FileDep = Annotated[File, Depends(get_file)]
