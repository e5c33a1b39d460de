"""POST /v1/jobs/{id}/pause and /resume over HTTP: the moves they make, idempotence, 409s
that say why, enqueue after commit, events and /metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from core.db.models import Job, utcnow
from core.jobs import state as jobstate
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


@pytest.fixture(scope="module")
def text_file(api: Api) -> str:
    return upload_rows(api.client(api.key_a), TEXT_ROWS)


def _job(client: httpx.Client, file_id: str) -> str:
    r = client.post("/v1/jobs", json=job_body(file_id))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _set(api: Api, job_id: str, **values: Any) -> None:
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))
        s.commit()


def _status_events(client: httpx.Client, job_id: str) -> list[tuple[str | None, str, str]]:
    events = client.get(f"/v1/jobs/{job_id}/events").json()["data"]
    return [(e["data"]["previous"], e["data"]["status"], e["data"].get("reason", ""))
            for e in events if e["type"] == "status"]


def test_pause_a_queued_job_pauses_it_at_once(client_a: httpx.Client, text_file: str) -> None:
    job_id = _job(client_a, text_file)
    r = client_a.post(f"/v1/jobs/{job_id}/pause")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "paused" and r.json()["finished_at"] is None
    assert r.json()["pauses"] == 0  # no attempt ran: none ended in a pause
    again = client_a.post(f"/v1/jobs/{job_id}/pause")
    assert again.status_code == 200 and again.json() == r.json()
    assert _status_events(client_a, job_id)[-1] == ("queued", "paused", "pause requested")


def test_pause_a_running_job_asks_its_worker(api: Api, client_a: httpx.Client,
                                             text_file: str) -> None:
    job_id = _job(client_a, text_file)
    _set(api, job_id, status="running", started_at=utcnow(), attempt=1, worker_id="w1")
    r = client_a.post(f"/v1/jobs/{job_id}/pause")
    assert r.status_code == 200 and r.json()["status"] == "pausing"
    assert client_a.post(f"/v1/jobs/{job_id}/pause").json()["status"] == "pausing"

    r = client_a.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "job_not_resumable" and err["param"] == "status"
    assert "still pausing" in err["message"]


def test_resume_queues_again_and_enqueues_after_commit(api: Api, client_a: httpx.Client,
                                                       text_file: str) -> None:
    job_id = _job(client_a, text_file)
    client_a.post(f"/v1/jobs/{job_id}/pause")
    api.enqueue.calls.clear()

    r = client_a.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 200 and r.json()["status"] == "queued"
    # The fake read the row on its own connection: it was committed before the enqueue.
    assert api.enqueue.calls == [(job_id, "queued")]
    again = client_a.post(f"/v1/jobs/{job_id}/resume")
    assert again.status_code == 200 and again.json()["status"] == "queued"
    assert api.enqueue.calls == [(job_id, "queued")]  # nothing to resume: not sent again
    assert _status_events(client_a, job_id)[-2:] == [
        ("queued", "paused", "pause requested"), ("paused", "queued", "resumed")]


@pytest.mark.parametrize("status", ["succeeded", "failed", "cancelled", "cancelling"])
def test_pause_or_resume_of_a_finished_or_cancelling_job_is_409(
    api: Api, client_a: httpx.Client, text_file: str, status: str
) -> None:
    job_id = _job(client_a, text_file)
    _set(api, job_id, status=status)
    for action, code in (("pause", "job_not_pausable"), ("resume", "job_not_resumable")):
        r = client_a.post(f"/v1/jobs/{job_id}/{action}")
        assert r.status_code == 409, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == (code, "status")
        assert f"job {job_id} is {status}" in err["message"]
    assert client_a.get(f"/v1/jobs/{job_id}").json()["status"] == status


def test_cancel_a_paused_job_cancels_it_at_once(client_a: httpx.Client, text_file: str) -> None:
    job_id = _job(client_a, text_file)
    client_a.post(f"/v1/jobs/{job_id}/pause")
    r = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200
    assert r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None


def test_cancel_a_pausing_job_hands_it_to_its_worker_as_a_cancel(
    api: Api, client_a: httpx.Client, text_file: str
) -> None:
    job_id = _job(client_a, text_file)
    _set(api, job_id, status="pausing", started_at=utcnow(), attempt=1, worker_id="w1")
    r = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelling"


def test_another_tenants_job_is_404(client_a: httpx.Client, client_b: httpx.Client,
                                    text_file: str) -> None:
    job_id = _job(client_a, text_file)
    for action in ("pause", "resume"):
        r = client_b.post(f"/v1/jobs/{job_id}/{action}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client_a.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"


def test_metrics_count_paused_and_pausing_jobs(api: Api, client_a: httpx.Client,
                                               text_file: str) -> None:
    def counts() -> dict[str, float]:
        text = httpx.get(api.url + "/metrics").text
        return {s.labels["status"]: s.value for f in text_string_to_metric_families(text)
                if f.name == "ftune_jobs" for s in f.samples}

    before = counts()
    job_id = _job(client_a, text_file)
    client_a.post(f"/v1/jobs/{job_id}/pause")
    other = _job(client_a, text_file)
    with api.session() as s:  # a worker runs it, then its pause is asked for
        assert jobstate.claim(s, other, worker_id="w1", max_attempts=3, now=utcnow())
        assert jobstate.request_pause(s, other, previous="running", now=utcnow())
        s.commit()
    after = counts()
    assert after["paused"] == before["paused"] + 1
    assert after["pausing"] == before["pausing"] + 1


def test_cli_pause_and_resume(api: Api, client_a: httpx.Client, text_file: str) -> None:
    from typer.testing import CliRunner

    from cli.main import app

    job_id = _job(client_a, text_file)
    args = ["--url", api.url, "--api-key", api.key_a]
    paused = CliRunner().invoke(app, ["pause", job_id, *args])
    assert (paused.exit_code, paused.output.strip()) == (0, "paused"), paused.output
    resumed = CliRunner().invoke(app, ["resume", job_id, *args])
    assert (resumed.exit_code, resumed.output.strip()) == (0, "queued"), resumed.output
    _set(api, job_id, status="succeeded")
    refused = CliRunner().invoke(app, ["pause", job_id, *args])
    assert refused.exit_code == 1
    assert "409 job_not_pausable" in " ".join(refused.output.split())


def test_a_paused_jobs_file_cannot_be_deleted(client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, TEXT_ROWS)
    job_id = _job(client_a, file_id)
    client_a.post(f"/v1/jobs/{job_id}/pause")
    r = client_a.delete(f"/v1/files/{file_id}")
    assert r.status_code == 409 and f"used by paused job {job_id}" in r.json()["error"]["message"]
