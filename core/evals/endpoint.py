"""Where a run's model answers: an OpenAI-compatible chat endpoint and the name the engine
knows the model by. One function stands between the evals and the serving path: the run
executor asks ``resolve_endpoint`` (or the resolver it is given), never a deployment table.

Today it reads the operator's settings (FTUNE_EVAL_ENDPOINTS: ftune model name -> base URL
and engine name); the serving path's resolver (a deployment per base model, adapters loaded
by name) plugs in here with the same signature."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from core.infra.settings import Settings


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # ends with /v1: {base_url}/chat/completions
    engine_model: str  # the model name the engine serves it under
    api_key: str | None = None


class EndpointUnavailable(RuntimeError):
    """No endpoint serves the model; the message says why (the run fails with it)."""


class EndpointResolver(Protocol):
    def __call__(self, tenant_id: str, model: str) -> Endpoint: ...


def resolve_endpoint(settings: Settings) -> EndpointResolver:
    """The resolver of the operator's settings."""

    def resolve(tenant_id: str, model: str) -> Endpoint:
        entry = settings.eval_endpoints.get(model)
        if entry is None:
            raise EndpointUnavailable(
                f"no endpoint serves model {model!r} (the operator lists served models in "
                "FTUNE_EVAL_ENDPOINTS)")
        return Endpoint(entry.base_url.rstrip("/"), entry.model or model,
                        settings.eval_endpoint_api_key)

    return resolve
