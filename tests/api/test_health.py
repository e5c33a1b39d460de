"""/healthz, /readyz, /metrics."""

from __future__ import annotations

import httpx

from api.main import create_app
from core.infra.settings import Settings
from tests.utils.api import TEXT_ROWS, Api, ServerThread, job_body, upload_rows


def test_readyz_ok_with_db_and_filesystem_broker(api: Api) -> None:
    r = api.client().get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "checks": {"database": "ok", "broker": "ok"}}


def test_readyz_503_names_what_failed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(
        data_dir=tmp_path,
        DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:1/nothing?connect_timeout=1",
        BROKER_URL="redis://127.0.0.1:1/0",
    )
    with ServerThread(create_app(settings)) as url:
        r = httpx.get(url + "/readyz", timeout=10)
        assert httpx.get(url + "/healthz").status_code == 200
    assert r.status_code == 503
    checks = r.json()["checks"]
    assert checks["database"].startswith("unreachable") and checks["broker"].startswith(
        "unreachable"
    )
    assert "127.0.0.1" not in r.text


def test_metrics_report_jobs_queue_age_and_requests(api: Api, client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    job_id = client_a.post("/v1/jobs", json=job_body(file_id)).json()["id"]
    client_a.get(f"/v1/jobs/{job_id}")
    client_a.get("/v1/jobs/job-doesnotexist")
    text = httpx.get(api.url + "/metrics").text
    assert 'ftune_jobs{status="queued"} 1.0' in text
    assert 'ftune_jobs{status="running"} 0.0' in text
    assert "ftune_queue_oldest_age_seconds " in text
    line = 'ftune_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="200"} 1.0'
    assert line in text
    assert 'route="/v1/jobs/{job_id}",status="404"} 1.0' in text
    assert (
        'ftune_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/jobs"}'
        in text
    )
