"""Structured logs: one JSON object per line with job and tenant, request lines, no secrets."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from api.main import create_app
from core.infra.logging import JsonFormatter, bind, configure_logging, log_context, redact
from core.infra.settings import Settings
from tests.utils.api import TEXT_ROWS, ServerThread, job_body, upload_rows


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    names = ("uvicorn", "uvicorn.error", "uvicorn.access")
    saved = [(root, list(root.handlers), root.level, root.propagate, root.disabled)]
    for name in names:
        lg = logging.getLogger(name)
        saved.append((lg, list(lg.handlers), lg.level, lg.propagate, lg.disabled))
    yield
    for lg, handlers, level, propagate, disabled in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


def lines(buf: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_extra_and_context(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("DEBUG", json=True, stream=buf)
    log = logging.getLogger("ftune.test")
    with log_context(job_id="job-1"):
        log.info("step %d", 3, extra={"step": 3})
        bind(tenant_id="ten-1")
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed")
        log.info("override", extra={"job_id": "job-2"})
    log.warning("outside")
    first, second, third, fourth = lines(buf)
    assert set(first) == {"time", "level", "logger", "message", "job_id", "step"}
    assert first["level"] == "INFO" and first["logger"] == "ftune.test"
    assert first["message"] == "step 3" and first["job_id"] == "job-1" and first["step"] == 3
    assert first["time"].endswith("+00:00")
    assert second["tenant_id"] == "ten-1" and "ValueError: bad" in second["exc_info"]
    assert third["job_id"] == "job-2"
    assert "job_id" not in fourth and "tenant_id" not in fourth


def test_context_bound_in_a_thread_reaches_the_scope_that_opened_it() -> None:
    import contextvars

    formatter = JsonFormatter()
    record = logging.LogRecord("x", logging.INFO, "", 0, "done", None, None)
    with log_context():
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(bind,), kwargs={"tenant_id": "ten-9"})
        t.start()
        t.join()
        assert json.loads(formatter.format(record))["tenant_id"] == "ten-9"


def test_secrets_are_masked() -> None:
    text = "Authorization: Bearer abc.def-123 and key ft_AbCdEf0123456789xyz, ft_ok"
    assert redact(text) == ("Authorization: Bearer [redacted] and key ft_[redacted], ft_ok")


def test_text_format_is_one_line_with_fields(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("INFO", json=False, stream=buf)
    with log_context(job_id="job-1"):
        logging.getLogger("ftune.test").info("hello")
    assert buf.getvalue().rstrip().endswith("INFO ftune.test: hello job_id=job-1")


@pytest.fixture
def logged_api(api_settings: Settings, restore_logging: None) -> Iterator[tuple[str, io.StringIO]]:
    app = create_app(api_settings)

    @app.get("/v1/boom")
    def boom() -> None:
        raise RuntimeError(f"leaky: Authorization: Bearer {api_settings.bootstrap_api_key}")

    server = ServerThread(app)  # uvicorn sets up its loggers here; ours go on top
    buf = io.StringIO()
    configure_logging("DEBUG", json=True, stream=buf)
    with server as url:
        yield url, buf


def test_request_lines_have_route_status_tenant_and_never_the_key(
    logged_api: tuple[str, io.StringIO], api_settings: Settings
) -> None:
    url, buf = logged_api
    key = api_settings.bootstrap_api_key
    assert key is not None
    wrong = "ft_wrong_" + "k" * 30
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=auth, timeout=20) as c:
        file_id = upload_rows(c, TEXT_ROWS)
        job_id = c.post("/v1/jobs", json=job_body(file_id)).json()["id"]
        assert c.get(f"/v1/jobs/{job_id}").status_code == 200
        assert c.post("/v1/jobs", json={"model": {}}).status_code == 422
        assert c.get("/v1/jobs/job-nope").status_code == 404
        assert c.get(f"/v1/jobs?api_key={key}").status_code == 200
        assert c.get("/healthz").status_code == 200
    # After a crash uvicorn closes the connection: a client of its own.
    assert httpx.get(url + "/v1/boom", headers=auth).status_code == 500
    assert (
        httpx.get(url + "/v1/jobs", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    )
    assert httpx.get(url + "/v1/jobs", headers={"Authorization": f"Basic {key}"}).status_code == 401

    text = buf.getvalue()
    records = lines(buf)  # every line is JSON
    assert key not in text and wrong not in text and "Bearer ft_" not in text
    requests = [r for r in records if r["logger"] == "ftune.api.request"]
    by_route = {(r["method"], r["route"], r["status"]): r for r in requests}
    got = by_route[("GET", "/v1/jobs/{job_id}", 200)]
    assert got["tenant_id"].startswith("ten-") and got["job_id"] == job_id
    assert got["path"] == f"/v1/jobs/{job_id}" and got["duration_ms"] >= 0
    assert got["level"] == "INFO" and got["message"] == "GET /v1/jobs/{job_id} 200"
    assert by_route[("POST", "/v1/jobs", 201)]["tenant_id"] == got["tenant_id"]
    assert by_route[("POST", "/v1/jobs", 422)]["tenant_id"] == got["tenant_id"]
    assert "job_id" not in by_route[("GET", "/v1/jobs/{job_id}", 404)]
    assert "tenant_id" not in by_route[("GET", "/v1/jobs", 401)]
    assert by_route[("GET", "/v1/boom", 500)]["level"] == "ERROR"
    assert ("GET", "/healthz", 200) not in by_route  # probes only at DEBUG
    assert all("?" not in r["path"] for r in requests)
    crashes = [r for r in records if "RuntimeError: leaky" in r.get("exc_info", "")]
    assert {r["logger"] for r in crashes} >= {"ftune.api"}
    assert all("Bearer [redacted]" in r["exc_info"] for r in crashes)
