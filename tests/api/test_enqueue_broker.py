"""The default enqueue (core.jobs.dispatch) with the real filesystem broker, and the app built
from the environment as `uvicorn api.main:app` builds it."""

from __future__ import annotations

import secrets

import httpx
import pytest

from core.infra.settings import Settings, reset_settings_cache
from tests.utils.api import TEXT_ROWS, ServerThread, job_body, upload_rows


def test_job_message_lands_in_the_filesystem_broker(
    settings_env: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.main import create_app
    from core.db.session import reset_engine_cache
    from core.jobs import dispatch

    key = "ft_" + secrets.token_hex(16)
    monkeypatch.setenv("FTUNE_BOOTSTRAP_API_KEY", key)
    reset_settings_cache()
    reset_engine_cache()
    try:
        with ServerThread(create_app()) as url:
            c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"})
            file_id = upload_rows(c, TEXT_ROWS)
            r = c.post("/v1/jobs", json=job_body(file_id))
            assert r.status_code == 201, r.text
            assert httpx.get(url + "/readyz").status_code == 200
            c.close()
        messages = list((settings_env.broker_dir / "messages").iterdir())
        assert len(messages) == 1
        assert r.json()["id"] in messages[0].read_text()
    finally:
        dispatch.reset_producers()
