"""POST /v1/chat/completions and /v1/completions, what code moved from OpenAI sends most,
answered before FastAPI's routing for a key the key cache trusts
(``ServeInferenceRequests``)."""

from __future__ import annotations

from fastapi import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import bearer_key, trusted_tenant
from api.errors import render_error
from api.openai import inference
from api.openai.inference import forward
from core.infra.errors import FtuneError
from core.infra.logging import bind

# The route's path -> the engine's path (api/openai/inference.py's two POST routes).
ENGINE_PATHS = {"/v1/chat/completions": "/chat/completions", "/v1/completions": "/completions"}


class ServeInferenceRequests:
    """Sends an inference request on to its engine with the routes' own ``forward``, before
    FastAPI's routing and dependency solving, when the request's key is one the key cache
    trusts (``trusted_tenant``). Matching the path against the app's routes and solving
    the route's dependencies were over half the API's CPU for such a request before it
    left for the engine (cProfile: routing 34 %, dependencies 21 %, the route's own work
    6 %), and 8 concurrent streams queue behind one another's (docs/benchmarks.md, serving
    round 6). Every other request, and one whose key must be verified first, goes on to
    the app, whose route answers the same way.

    Pure ASGI, inside ObserveRequests: its answers are logged and counted under the route's
    template, with the tenant bound as the route binds it. An FtuneError (a bad body, a
    429, a 404 model, a 503 engine) is answered as the app's handler answers it; anything
    else goes up to the app's handler of unexpected errors, as from a route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._routes: dict[str, BaseRoute] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine_path = ENGINE_PATHS.get(scope.get("path", "")) if scope["type"] == "http" \
            and scope["method"] == "POST" else None
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"),
                             None) if engine_path else None
        key = bearer_key(authorization.decode("latin-1")) if authorization else None
        tenant = trusted_tenant(scope["app"].state, key) if key else None
        if engine_path is None or tenant is None:
            await self.app(scope, receive, send)
            return
        bind(tenant_id=tenant.id)
        scope["route"] = self._route(scope["path"])
        request = Request(scope, receive)
        try:
            response = await forward(request, tenant, request.app.state.settings, engine_path)
        except FtuneError as exc:
            response = render_error(exc, request)
        await response(scope, receive, send)

    def _route(self, path: str) -> BaseRoute:
        """The route that would have answered (the inference router's, included in the
        app: the app's own list holds the router, not its routes)."""
        route = self._routes.get(path)
        if route is None:
            route = self._routes[path] = next(
                r for r in inference.router.routes
                if getattr(r, "path", None) == path and "POST" in getattr(r, "methods", ()))
        return route
