"""OpenAI's inference routes on ftune: POST /v1/chat/completions and /v1/completions, and
DELETE /v1/models/{model} (``models.delete``). Thin: core/serving/ resolves the name for the
tenant and makes sure its deployment and adapter are up; api/openai/proxy.py forwards."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from api.bodies import parse_json_body, read_body
from api.deps import CurrentTenant, SessionDep, SettingsDep, bearer_key
from api.errors import error_responses
from api.openai import proxy
from api.openai.model_lookup import get_model
from api.openai.targets import TargetCache
from api.services import keys, rate_limits
from core.db.models import Job, Tenant
from core.db.session import after_commit
from core.infra.errors import InvalidRequest
from core.infra.settings import Settings
from core.serving import usage
from core.serving.access import EngineTarget, open_model
from core.serving.deployments import ServingUnavailable
from core.serving.names import parse_ft_name
from core.serving.retire import retire

log = logging.getLogger("ftune.api")
router = APIRouter(prefix="/v1", tags=["inference"], responses=error_responses(401))


class ModelDeleted(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool


@router.post("/chat/completions", responses=error_responses(400, 404, 413, 429, 503))
async def chat_completions(request: Request, tenant: CurrentTenant,
                           settings: SettingsDep) -> Response:
    """client.chat.completions.create: answered by the model's engine (vLLM)."""
    return await forward(request, tenant, settings, "/chat/completions")


@router.post("/completions", responses=error_responses(400, 404, 413, 429, 503))
async def completions(request: Request, tenant: CurrentTenant,
                      settings: SettingsDep) -> Response:
    """client.completions.create: answered by the model's engine (vLLM)."""
    return await forward(request, tenant, settings, "/completions")


@router.delete("/models/{model}", response_model=ModelDeleted,
               responses=error_responses(400, 404))
def delete_model(model: str, request: Request, session: SessionDep, tenant: CurrentTenant,
                 settings: SettingsDep) -> ModelDeleted:
    """client.models.delete: a fine-tuned model's names become unknown and the engines
    drop it; the job, its files and its checkpoints stay."""
    ft = parse_ft_name(model)
    if model in settings.model_catalog or (ft is not None and ft.step is not None):
        raise InvalidRequest(f"model {model!r} is not a fine-tuned model: only those (ft: "
                             "names without :ckpt-step-N) can be deleted", param="model")
    found = get_model(session, tenant, settings, model)  # 404 if not yours
    job = session.get(Job, found.ftune_job_id) if found.ftune_job_id else None
    if job is None:
        raise InvalidRequest(f"model {model!r} is not a fine-tuned model", param="model")
    retire(session, job)
    # Its names (and its checkpoints') are unknown from now on: once the retirement is
    # committed, so that no resolution reads the model as it was before and keeps it.
    targets: TargetCache = request.app.state.targets
    after_commit(session, lambda: targets.forget_tenant(tenant.id))
    return ModelDeleted(id=model, deleted=True)


async def forward(request: Request, tenant: Tenant, settings: Settings, path: str) -> Response:
    """The request sent to its model's engine and the answer passed back: what both routes
    do, and what api/middleware/inference_requests.py calls before FastAPI's routing."""
    body = parse_json_body(await read_body(request, settings.serving_max_request_bytes))
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", param="body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: required, the name of a model (GET /v1/models lists "
                             "them)", param="model")
    subject = rate_limits.key_subject(keys.hash_key(
        bearer_key(request.headers.get("authorization", "")) or ""))
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter
    admitted = limiter.admit_held(subject, settings)  # a 429 here starts no engine
    if isinstance(admitted, rate_limits.NeedsRow):  # the key's lease is used up
        admitted = await run_in_threadpool(_admit_row, request, subject, settings)
    elif limiter.wants_more(subject, settings):  # the next lease, before this one runs out
        _in_background(run_in_threadpool(_top_up, request, subject, settings))
    targets: TargetCache = request.app.state.targets
    key = (tenant.id, model)
    maker = request.app.state.sessionmaker

    def resolve() -> EngineTarget:
        return open_model(maker, tenant, model, settings)

    # The common case is decided on the event loop: no trip to a thread, which costs the
    # GIL's handoffs before the first token of every request (api/openai/targets.py).
    target = targets.fresh(key, resolve)
    cached = target is not None
    if target is None:
        target = await targets.resolved(key, resolve)
    stream = body.get("stream") is True
    keep_usage = False
    if stream:
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        keep_usage = options.get("include_usage") is True
        body = {**body, "stream_options": {**options, "include_usage": True}}
    sent: proxy.EngineResponse | None = None
    try:
        sent = await _send(targets, key, target, path, body)
    except ServingUnavailable:
        if not cached:
            raise
    if sent is None or (cached and sent.status == 404):
        # Since the name was cached the engine dropped it (an adapter evicted, the model
        # deleted) or went away (its deployment stopped or moved): the name is resolved
        # again (starting the deployment, loading the adapter, or a 404), sent once more.
        if sent is not None:
            sent.close()
        target = await targets.resolved(key, resolve)
        sent = await _send(targets, key, target, path, body)
    response = sent
    swap = proxy.NameSwap(target)

    async def on_usage(used: proxy.Usage) -> None:
        await _count(request, tenant.id, model, used, admitted)

    if response.status >= 400:
        raw = await response.read()
        prompt_param = "messages" if path == "/chat/completions" else "prompt"
        return JSONResponse(proxy.openai_error(_json(raw), response.status,
                                               prompt_param=prompt_param),
                            status_code=response.status)
    # The usage is counted once the answer's last byte went out (a background task runs
    # after the response's end), and written with the second's others (core/serving/usage.py).
    if stream and response.content_type.startswith("text/event-stream"):
        used = proxy.Usage()
        return StreamingResponse(
            proxy.relay_events(response, swap, used, keep_usage_chunk=keep_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(on_usage, used))
    raw = await response.read()
    return Response(swap(raw), status_code=response.status,
                    media_type=response.content_type or "application/json",
                    background=BackgroundTask(on_usage, proxy.usage_of(_json(raw))))


def _top_up(request: Request, subject: str, settings: Settings) -> None:
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter
    try:
        with request.app.state.sessionmaker() as session:
            limiter.top_up(session, subject, settings)
    except Exception:  # the request that finds the lease empty asks the row itself
        log.exception("could not top up the key's inference lease")


# Tasks no request waits for, held until done (the event loop keeps only a weak reference).
_background: set[asyncio.Future[Any]] = set()


def _in_background(work: Coroutine[Any, Any, Any]) -> None:
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_background.discard)


def _admit_row(request: Request, subject: str, settings: Settings
               ) -> rate_limits.Admitted | None:
    """The key's minute row, asked when this process's lease is used up (a 429 here
    starts no engine)."""
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter
    with request.app.state.sessionmaker() as session:
        return limiter.admit(session, subject, settings)


async def _send(targets: TargetCache, key: tuple[str, str], target: EngineTarget, path: str,
                body: dict[str, Any]) -> proxy.EngineResponse:
    try:
        response = await proxy.open_stream(target, path, {**body, "model": target.engine_model})
    except ServingUnavailable:
        targets.forget(key)
        raise
    if response.status == 404:
        targets.forget(key)
    return response


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return {"error": {"message": raw.decode(errors="replace")[:2000]}}


async def _count(request: Request, tenant_id: str, model: str, used: proxy.Usage,
                 admitted: rate_limits.Admitted | None) -> None:
    metrics = request.app.state.metrics
    metrics.inference_requests.labels(tenant_id, model).inc()
    metrics.inference_tokens.labels(tenant_id, model, "prompt").inc(used.prompt_tokens)
    metrics.inference_tokens.labels(tenant_id, model, "completion").inc(used.completion_tokens)
    buffer: usage.UsageBuffer = request.app.state.usage_buffer
    buffer.add(tenant_id, model, used.prompt_tokens, used.completion_tokens)
    settings: Settings = request.app.state.settings
    if admitted is None or not settings.inference_tokens_per_minute_per_key:
        return  # no token limit: nothing else to count
    maker = request.app.state.sessionmaker
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter

    def add_tokens() -> None:
        with maker() as session:
            limiter.add_tokens(session, admitted, used.prompt_tokens + used.completion_tokens,
                               settings)

    try:
        await run_in_threadpool(add_tokens)
    except Exception:  # the answer went out; losing its count must not fail it
        log.exception("could not count the answer's tokens against the key's limit")


def write_usage(maker: sessionmaker[Session], buffer: usage.UsageBuffer) -> None:
    with maker() as session:
        buffer.flush(session)


async def write_usage_every_second(maker: sessionmaker[Session],
                                   buffer: usage.UsageBuffer) -> None:
    """The API process's usage writer (core/serving/usage.py says why it is batched): runs
    for the process's life; the lifespan cancels it, then writes what is left."""
    while True:
        await asyncio.sleep(usage.FLUSH_SECONDS)
        if buffer:
            try:
                await run_in_threadpool(write_usage, maker, buffer)
            except Exception:  # the next second tries again; the buffer kept its counts
                log.exception("could not write inference usage")
