"""The FastAPI app: ``uvicorn api.main:app`` (settings from the environment, see
core/infra/settings.py), or ``create_app(settings, enqueue=...)`` in tests and embedded setups."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.commit_notices import CommitNotices
from api.deps import READ_THREADS, Enqueue
from api.errors import install_error_handlers
from api.evals import routes as evals_routes
from api.metrics import Metrics
from api.middleware.inference_requests import ServeInferenceRequests
from api.middleware.observe import ObserveRequests
from api.middleware.polled_jobs import ServePolledJobs
from api.openai import inference
from api.openai import routes as openai_routes
from api.openai.schemas import JobCreate
from api.openai.targets import TargetCache
from api.readcache import ReadCache, Version
from api.routes import deployments, files, graders, health, jobs, ui, usage, webhooks, workers
from api.services.health import ensure_broker_folders
from api.services.keys import ensure_bootstrap_key
from api.services.rate_limits import InferenceLimiter
from core.db.session import (
    LoopReads,
    get_sessionmaker,
    make_engine,
    make_loop_read_engine,
    make_read_engine,
    unit_of_work,
)
from core.infra.logging import configure_logging
from core.infra.settings import Settings, get_settings
from core.serving.usage import UsageBuffer
from core.spec import JobSpec

log = logging.getLogger("ftune.api")


def create_app(
    settings: Settings | None = None,
    *,
    enqueue: Enqueue | None = None,
    session_factory: sessionmaker[Session] | None = None,
    server_process: bool = False,
) -> FastAPI:
    """Build the app. Nothing is read or opened until start-up (the lifespan).

    ``settings``: default the process settings (environment). ``enqueue``: how a committed job
    is handed to the workers; default ``core.jobs.dispatch.enqueue_job``. ``session_factory``:
    default one engine for ``settings.database_url``. ``server_process``: the process is
    the API server (``uvicorn api.main:app``): JSON log lines on stderr (core/infra/logging.py) at
    ``settings.log_level``, and what start-up loaded is kept out of the garbage collector's
    scans (``_freeze_startup_objects``)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s = settings or get_settings()
        if server_process:
            configure_logging(s.log_level, json=True)
        logging.getLogger("ftune").setLevel(s.log_level.upper())
        engine = None
        maker = session_factory
        if maker is None and settings is None:
            maker = get_sessionmaker()
        elif maker is None:
            assert s.database_url is not None
            if s.is_sqlite:
                s.data_dir.mkdir(parents=True, exist_ok=True)
            engine = make_engine(s.database_url)
            maker = sessionmaker(bind=engine, expire_on_commit=False)
        app.state.settings = s
        app.state.sessionmaker = maker
        bind = maker.kw.get("bind")
        loop_engine = make_loop_read_engine(bind) if isinstance(bind, Engine) else None
        # Reads on the event loop (api/deps.py Reader): only for a SQLite file.
        app.state.loop_reads = LoopReads(loop_engine) if loop_engine else None
        # Job bodies sent again while the database is unchanged (api/readcache.py): its
        # version is SQLite's data_version on the loop's read connection, or on PostgreSQL
        # the commits its notices have told this process of (api/commit_notices.py).
        notices = None
        app.state.read_cache = None
        if s.job_read_cache_seconds > 0 and app.state.loop_reads is not None:
            loop_reads = app.state.loop_reads
            app.state.read_cache = ReadCache(
                lambda job_id: Version.of(loop_reads.data_version()), s.job_read_cache_seconds)
        elif (s.job_read_cache_seconds > 0 and isinstance(bind, Engine)
              and bind.dialect.name == "postgresql"):
            notices = CommitNotices(bind)
            event.listen(maker, "after_commit", notices.committed_here)
            app.state.read_cache = ReadCache(notices.version, s.job_read_cache_seconds)
        # Elsewhere (PostgreSQL) the reads go to threads, on an engine of their own.
        read_engine = (make_read_engine(bind, READ_THREADS)
                       if isinstance(bind, Engine) and loop_engine is None else None)
        app.state.read_sessionmaker = (sessionmaker(bind=read_engine, expire_on_commit=False)
                                       if read_engine is not None else None)
        s.uploads_dir.mkdir(parents=True, exist_ok=True)
        try:
            ensure_broker_folders(s)
        except OSError:
            log.exception("could not create the broker folders")
        if s.bootstrap_api_key:
            with unit_of_work(maker) as session:
                ensure_bootstrap_key(session, s.bootstrap_api_key)
        if server_process:
            _freeze_startup_objects()
        usage_writer = asyncio.create_task(
            inference.write_usage_every_second(maker, app.state.usage_buffer))
        try:
            yield
        finally:
            usage_writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await usage_writer
            try:  # the last second's answers
                await run_in_threadpool(inference.write_usage, maker, app.state.usage_buffer)
            except Exception:
                log.exception("could not write the last inference usage")
            await inference.proxy.close_client()  # bound to this event loop
            executor = getattr(app.state, "read_executor", None)  # api/deps.py read_executor
            if executor is not None:
                executor.shutdown(wait=False)
                app.state.read_executor = None
            if app.state.loop_reads is not None:
                app.state.loop_reads.close()
                app.state.loop_reads = None
            if notices is not None:
                event.remove(maker, "after_commit", notices.committed_here)
                notices.close()
                app.state.read_cache = None
            if read_engine is not None:
                read_engine.dispose()
                app.state.read_sessionmaker = None
            if engine is not None:
                engine.dispose()

    app = FastAPI(
        title="ftune",
        version="1",
        summary="Fine-tuning jobs: upload a dataset, submit a job, download the adapter.",
        lifespan=lifespan,
        # ftune reports through /metrics and its JSON log lines, not OpenTelemetry. Left on,
        # FastAPI asks OpenTelemetry on every request whether a provider was set up (8 us:
        # ~7 % of a polled job answered from a kept body, py-spy under load).
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.settings = settings
    app.state.sessionmaker = session_factory
    app.state.enqueue = enqueue
    app.state.loop_reads = None
    app.state.read_cache = None
    app.state.read_sessionmaker = None
    app.state.metrics = Metrics(lambda: getattr(app.state, "sessionmaker", None))
    app.state.inference_limiter = InferenceLimiter()  # api/services/rate_limits.py
    app.state.targets = TargetCache()  # where model names are served: api/openai/targets.py
    app.state.usage_buffer = UsageBuffer()  # core/serving/usage.py
    # Innermost first: polled jobs and inference requests are answered inside
    # ObserveRequests (logged and counted as any request), which is inside the UI's headers.
    app.add_middleware(ServePolledJobs)
    app.add_middleware(ServeInferenceRequests)
    app.add_middleware(ObserveRequests, metrics=app.state.metrics)
    app.add_middleware(ui.UISecurityHeaders)
    install_error_handlers(app)
    # The probes first, then what a dashboard polls: FastAPI tries the routes in order, and
    # each one passed over costs a few microseconds (GET job: 0.014 ms of 0.39 when the file
    # routes were ahead of it).
    app.include_router(health.router)
    jobs.add_polled_routes(app)
    app.include_router(jobs.router)
    app.include_router(files.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_routes.models)
    app.include_router(inference.router)
    app.include_router(webhooks.router)
    app.webhooks.include_router(webhooks.events)
    app.include_router(usage.router)
    app.include_router(graders.router)
    app.include_router(evals_routes.router)
    app.include_router(workers.router)
    app.include_router(deployments.router)
    app.include_router(ui.router)
    app.mount("/ui/static", ui.static_files(), name="ui-static")
    _document_job_spec(app)
    return app


def _freeze_startup_objects() -> None:
    """Move everything loaded so far (modules, the app, the engine: ~105,000 objects) out of
    the cyclic garbage collector's reach. Under load its full pass ran about once a second
    and walked all of them each time (30 ms here), while the loop served nothing: that set
    the p99 latency. Measured with wrk at 100 connections, p99 of /healthz 76 -> 9 ms and
    of GET job 111 -> 43 ms. What is frozen lives as long as the process anyway."""
    gc.collect()
    gc.freeze()


def _document_job_spec(app: FastAPI) -> None:
    """POST /v1/jobs reads the raw body (so every problem is reported together); show the
    JobSpec schema in the OpenAPI document anyway."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            routes=app.routes,
            webhooks=app.webhooks.routes,
        )
        spec_schema = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        components.update(spec_schema.pop("$defs", {}))
        components["JobSpec"] = spec_schema
        # POST /v1/fine_tuning/jobs reads its raw body too (OpenAI's errors, from one place).
        create = JobCreate.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(create.pop("$defs", {}))
        components["JobCreate"] = create
        _errors_are_error_bodies(schema)
        post = schema.get("paths", {}).get("/v1/jobs", {}).get("post")
        if post is not None:
            post["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}}
                },
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _errors_are_error_bodies(schema: dict[str, Any]) -> None:
    """FastAPI documents request validation failures with its own body; ours renders them as
    ``ErrorBody`` (api/errors.py), so say that."""
    ours = {
        "description": "Invalid request: every problem is listed in `details`.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
    }
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            content = responses.get("422", {}).get("content", {}).get("application/json", {})
            if content.get("schema", {}).get("$ref", "").endswith("/HTTPValidationError"):
                responses["422"] = ours
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


app = create_app(server_process=True)
