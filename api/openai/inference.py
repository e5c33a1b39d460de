"""OpenAI's inference routes on ftune: POST /v1/chat/completions and /v1/completions, and
DELETE /v1/models/{model} (``models.delete``). Thin: core/serving/ resolves the name for the
tenant and makes sure its deployment and adapter are up; api/openai/proxy.py forwards."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any, Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
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
    admitted, target, cached = await run_in_threadpool(_admit_and_open, request, subject,
                                                       tenant, model, settings)
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
    # The usage is written once the answer's last byte went out (a background task runs
    # after the response's end): an answer waited for its database write before, and the
    # writes of concurrent answers queue behind each other.
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


def _admit_and_open(request: Request, subject: str, tenant: Tenant, model: str,
                    settings: Settings
                    ) -> tuple[rate_limits.Admitted | None, EngineTarget, bool]:
    """The key's rate limit first (a 429 starts no engine), then the model's engine: one
    trip to the thread pool for both. The last item says the target came from the cache."""
    maker = request.app.state.sessionmaker
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter
    with maker() as session:
        admitted = limiter.admit(session, subject, settings)
    key, now = (tenant.id, model), time.monotonic()
    with _targets_lock:
        found = _targets.get(key)
    if found is not None and now - found[0] < TARGET_SECONDS:
        return admitted, found[1], True
    target = open_model(maker, tenant, model, settings)
    with _targets_lock:
        if len(_targets) > 10_000:
            _targets.clear()
        _targets[key] = (now, target)
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
    maker = request.app.state.sessionmaker
    settings: Settings = request.app.state.settings
    limiter: rate_limits.InferenceLimiter = request.app.state.inference_limiter

    def write() -> None:
        with maker() as session:
            usage.record(session, tenant_id, model, used.prompt_tokens, used.completion_tokens)
            if admitted is not None:
                limiter.add_tokens(session, admitted,
                                   used.prompt_tokens + used.completion_tokens, settings)

    try:
        await run_in_threadpool(write)
    except Exception:  # the answer went out; losing its count must not fail it
        log.exception("could not record inference usage")
