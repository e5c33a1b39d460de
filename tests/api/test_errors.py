"""One error shape for everything: unknown routes, bad parameters, rate limits, bugs."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from api.main import create_app
from core.infra.settings import Settings
from tests.utils.api import TEXT_ROWS, ServerThread, job_body, upload_rows


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    return api_settings.model_copy(update={"jobs_per_minute_per_tenant": 2})


def test_unknown_route_is_404_in_error_shape(client_a: httpx.Client) -> None:
    r = client_a.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json() == {"error": {"code": "not_found", "message": "Not Found", "param": None}}


def test_bad_json_body_is_422(client_a: httpx.Client) -> None:
    r = client_a.post(
        "/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_request"


def test_rate_limit_is_429_with_retry_after(client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    codes = [client_a.post("/v1/jobs", json=job_body(file_id)).status_code for _ in range(3)]
    assert codes == [201, 201, 429]
    r = client_a.post("/v1/jobs", json=job_body(file_id))
    assert r.json()["error"]["code"] == "rate_limited"
    assert 1 <= int(r.headers["retry-after"]) <= 60


@pytest.fixture
def broken_url(api_settings: Settings) -> Iterator[str]:
    app = create_app(api_settings)

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError("secret internals: password=hunter2")

    with ServerThread(app) as url:
        yield url


def test_unhandled_error_is_500_without_internals(broken_url: str) -> None:
    r = httpx.get(broken_url + "/v1/boom")
    assert r.status_code == 500
    assert r.json() == {
        "error": {"code": "internal", "message": "internal server error", "param": None}
    }
