"""OpenAI's inference routes on ftune: POST /v1/chat/completions and /v1/completions, and
DELETE /v1/models/{model} (``models.delete``). Thin: core/serving/ resolves the name for the
tenant and makes sure its deployment and adapter are up; api/openai/proxy.py forwards."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any, Literal

import httpx
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
from api.services import keys, rate_limits
from core.db.models import Job, Tenant
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
    return await _forward(request, tenant, settings, "/chat/completions")


@router.post("/completions", responses=error_responses(400, 404, 413, 429, 503))
async def completions(request: Request, tenant: CurrentTenant,
                      settings: SettingsDep) -> Response:
    """client.completions.create: answered by the model's engine (vLLM)."""
    return await _forward(request, tenant, settings, "/completions")


@router.delete("/models/{model}", response_model=ModelDeleted,
               responses=error_responses(400, 404))
def delete_model(model: str, session: SessionDep, tenant: CurrentTenant,
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
    with _targets_lock:  # its names (and its checkpoints') are unknown from now on
        for key in [k for k in _targets if k[0] == tenant.id]:
            _targets.pop(key, None)
    return ModelDeleted(id=model, deleted=True)


async def _forward(request: Request, tenant: Tenant, settings: Settings, path: str) -> Response:
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
    held = limiter.admit_held(subject, settings)  # a 429 here starts no engine
    known = _cached_target(tenant, model)
    if not isinstance(held, rate_limits.NeedsRow) and known is not None:
        # The common case, decided on the event loop: no trip to a thread, which costs
        # the GIL's handoffs before the first token of every request.
        admitted, target, cached = held, known, True
    else:
        admitted, target, cached = await run_in_threadpool(
            _admit_and_open, request, subject, tenant, model, settings, held, known)
    stream = body.get("stream") is True
    keep_usage = False
    if stream:
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        keep_usage = options.get("include_usage") is True
        body = {**body, "stream_options": {**options, "include_usage": True}}
    response = await _send(target, path, body, tenant, model)
    if response.status_code == 404 and cached:
        # An adapter evicted or a deployment moved since the name was cached: resolved
        # again (loading the adapter), and sent once more.
        await response.aclose()
        target = await run_in_threadpool(open_model, request.app.state.sessionmaker, tenant,
                                         model, settings)
        response = await _send(target, path, body, tenant, model)
    swap = proxy.NameSwap(target)

    async def on_usage(used: proxy.Usage) -> None:
        await _count(request, tenant.id, model, used, admitted)

    if response.status_code >= 400:
        raw = await response.aread()
        await response.aclose()
        prompt_param = "messages" if path == "/chat/completions" else "prompt"
        return JSONResponse(proxy.openai_error(_json(raw), response.status_code,
                                               prompt_param=prompt_param),
                            status_code=response.status_code)
    # The usage is counted once the answer's last byte went out (a background task runs
    # after the response's end), and written with the second's others (core/serving/usage.py).
    if stream and response.headers.get("content-type", "").startswith("text/event-stream"):
        used = proxy.Usage()
        return StreamingResponse(
            proxy.relay_events(response, swap, used, keep_usage_chunk=keep_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(on_usage, used))
    raw = await response.aread()
    await response.aclose()
    return Response(swap(raw), status_code=response.status_code,
                    media_type=response.headers.get("content-type", "application/json"),
                    background=BackgroundTask(on_usage, proxy.usage_of(_json(raw))))


# Where a tenant's model name was last found ready, per API process, for TARGET_SECONDS:
# resolving it (the job, the deployment, the adapter rows) costs more database reads than
# the rest of a request. Within that second a deployment stopped or an adapter evicted
# meanwhile is met as the engine's refusal, and the entry is dropped (``_forget``); once a
# second the name is resolved again, which also refreshes the deployment's last use.
TARGET_SECONDS = 1.0
_targets: dict[tuple[str, str], tuple[float, EngineTarget]] = {}
_targets_lock = threading.Lock()


def _cached_target(tenant: Tenant, model: str) -> EngineTarget | None:
    """The engine ``model`` was found on in the last TARGET_SECONDS, if any."""
    with _targets_lock:
        found = _targets.get((tenant.id, model))
    if found is not None and time.monotonic() - found[0] < TARGET_SECONDS:
        return found[1]
    return None


def _admit_and_open(request: Request, subject: str, tenant: Tenant, model: str,
                    settings: Settings, held: rate_limits.Admitted | None | rate_limits.NeedsRow,
                    known: EngineTarget | None
                    ) -> tuple[rate_limits.Admitted | None, EngineTarget, bool]:
    """What the event loop could not decide, in one trip to the thread pool: the key's
    minute row when its lease is used up (a 429 starts no engine), then the model's engine
    when the name is not cached (``held`` and ``known``: what the loop found). The last item
    says the target came from the cache."""
    maker = request.app.state.sessionmaker
    if isinstance(held, rate_limits.NeedsRow):
        limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter
        with maker() as session:
            admitted = limiter.admit(session, subject, settings)
    else:
        admitted = held
    if known is not None:
        return admitted, known, True
    now = time.monotonic()
    target = open_model(maker, tenant, model, settings)
    with _targets_lock:
        if len(_targets) > 10_000:
            _targets.clear()
        _targets[(tenant.id, model)] = (now, target)
    return admitted, target, False


async def _send(target: EngineTarget, path: str, body: dict[str, Any], tenant: Tenant,
                model: str) -> httpx.Response:
    try:
        response = await proxy.open_stream(target, path, {**body, "model": target.engine_model})
    except ServingUnavailable:
        _forget(tenant, model)
        raise
    if response.status_code == 404:
        _forget(tenant, model)
    return response


def _forget(tenant: Tenant, model: str) -> None:
    with _targets_lock:
        _targets.pop((tenant.id, model), None)


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
