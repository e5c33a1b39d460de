"""Inference requests answered before FastAPI's routing (api/middleware/
inference_requests.py): a trusted key's request is sent by the middleware with the routes'
own ``forward`` and answered as the route answers it; a key to verify goes to the route.
No engine runs here: a catalog model answers 503 (no engine installed), which is the whole
way through resolving the name; tests/e2e/test_serving.py streams through a real one."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.middleware import inference_requests
from core.infra.settings import Settings
from tests.utils.api import Api, one_model_settings

BASE = "tiny"


@pytest.fixture(scope="module")
def api_settings(tmp_path_factory: pytest.TempPathFactory, db_url: str) -> Settings:
    return one_model_settings(tmp_path_factory.mktemp("ftune"), db_url, BASE)


@pytest.fixture
def sent_by_middleware(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The engine paths the middleware forwarded (the app runs in this process)."""
    calls: list[str] = []
    real = inference_requests.forward

    async def spy(request: Any, tenant: Any, settings: Any, path: str) -> Any:
        calls.append(path)
        return await real(request, tenant, settings, path)

    monkeypatch.setattr(inference_requests, "forward", spy)
    yield calls


def chat(client: httpx.Client, **body: object) -> httpx.Response:
    return client.post("/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], **body})


def test_a_trusted_key_is_served_before_routing_as_the_route_serves_it(
        api: Api, sent_by_middleware: list[str]) -> None:
    c = api.client(api.key_b)
    first = chat(c, model=BASE)  # a key not verified yet: the route, which verifies it
    assert sent_by_middleware == []
    again = chat(c, model=BASE)
    assert sent_by_middleware == ["/chat/completions"]
    assert (again.status_code, again.json()) == (first.status_code, first.json())
    assert first.status_code == 503 and "make engine" in first.json()["error"]["message"]
    assert again.headers["retry-after"] == first.headers["retry-after"]
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert sent_by_middleware[-1] == "/completions"
    assert (r.status_code, r.json()["error"]["param"]) == (400, "model")


def test_its_answers_are_counted_under_the_routes_template(api: Api) -> None:
    c = api.client(api.key_a)
    chat(c, model=BASE)
    chat(c, model=BASE)
    text = api.client(api.key_a).get("/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("ftune_http_requests_total")
                and 'route="/v1/chat/completions"' in ln and 'status="503"' in ln)
    assert float(line.rsplit(" ", 1)[1]) >= 2


def test_an_unknown_key_goes_to_the_route_and_is_refused(
        api: Api, sent_by_middleware: list[str]) -> None:
    r = chat(api.client("ft_unknown_" + secrets.token_hex(8)), model=BASE)
    assert r.status_code == 401 and sent_by_middleware == []
