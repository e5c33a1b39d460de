"""Where a run's model answers: an OpenAI-compatible chat endpoint and the name the engine
knows the model by. One function stands between the evals and the serving path: the run
executor asks a resolver made by ``engine_resolver``, never a deployment table.

A model is served by ftune's own deployments (core/serving/access.py ``open_model``: the
tenant's name resolved and confined, the base model's engine started or awaited, the adapter
loaded), unless the operator names it in FTUNE_EVAL_ENDPOINTS: an engine ftune does not run
(a GPU box's own vLLM, a hosted model), which every tenant may evaluate against.

A deployment still starting is waited for (heart-beating the run, which reads a cancel) up
to FTUNE_SERVING_START_TIMEOUT_SECONDS, the bound after which the supervisor itself gives up
on an engine; then the run fails saying so. An engine that is not installed, a deployment
that failed, or a name that is not the tenant's fail the run at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Tenant
from core.infra.errors import FtuneError
from core.infra.settings import Settings
from core.serving.access import open_model
from core.serving.deployments import ServingUnavailable
from core.serving.resolve import ModelNotFound, resolve

STARTING = "deployment_starting"


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # ends with /v1: {base_url}/chat/completions
    engine_model: str  # the model name the engine serves it under
    api_key: str | None = None


class EndpointUnavailable(RuntimeError):
    """Nothing serves the model; ``code`` and the message say why (the run fails with them)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EndpointResolver(Protocol):
    def __call__(self, tenant_id: str, model: str, *, job_id: str | None = None,
                 waiting: Callable[[], bool] = ...) -> Endpoint:
        """``job_id``: the run evaluates that job while it trains (its checkpoints are
        served before it succeeded); ``waiting`` is called while a deployment starts and
        returns False to stop waiting (the run was canceled)."""


def check_model(session: Session, tenant: Tenant, model: str, settings: Settings) -> None:
    """At create: the run's model is an operator's endpoint or a name the serving path
    resolves for this tenant (core/serving/resolve.py); raises ModelNotFound otherwise."""
    if model not in settings.eval_endpoints:
        resolve(session, tenant, model, settings)


def engine_resolver(maker: sessionmaker[Session], settings: Settings) -> EndpointResolver:
    def resolve(tenant_id: str, model: str, *, job_id: str | None = None,
                waiting: Callable[[], bool] = lambda: True) -> Endpoint:
        entry = settings.eval_endpoints.get(model)
        if entry is not None:
            return Endpoint(entry.base_url.rstrip("/"), entry.model or model,
                            settings.eval_endpoint_api_key)
        with maker() as session:
            tenant = session.get(Tenant, tenant_id)
            if tenant is None:
                raise EndpointUnavailable(f"tenant {tenant_id} is gone", "model_not_found")
            session.expunge(tenant)
        deadline = time.monotonic() + settings.serving_start_timeout_seconds
        step = max(1.0, settings.eval_heartbeat_seconds)
        while True:
            try:
                target = open_model(maker, tenant, model, settings, wait_seconds=step,
                                    evaluating=job_id)
                return Endpoint(target.base_url, target.engine_model, target.api_key)
            except ModelNotFound:
                raise EndpointUnavailable(f"model {model!r} does not exist or is not yours "
                                          "(GET /v1/models lists yours)",
                                          "model_not_found") from None
            except ServingUnavailable as e:
                if e.code != STARTING:
                    raise EndpointUnavailable(str(e), str(e.code)) from None
            except FtuneError as e:  # the engine refused the adapter
                raise EndpointUnavailable(str(e), str(e.code)) from None
            if time.monotonic() >= deadline or not waiting():
                raise EndpointUnavailable(
                    f"the deployment of {model!r} was still not ready after "
                    f"{settings.serving_start_timeout_seconds:.0f} s "
                    "(FTUNE_SERVING_START_TIMEOUT_SECONDS; are the workers' serving "
                    "slots all taken?); run it again once it serves", STARTING)

    return resolve
