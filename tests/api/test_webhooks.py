"""/v1/webhooks over HTTP: registration (URL checked, secret shown once), tenant isolation,
deliveries, a test event on demand, and a cancel through the API sending job.cancelled to a
real local receiver."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from standardwebhooks import Webhook

from api.schemas import JobSummary, WebhookPayload
from core.infra.settings import Settings
from core.webhooks import outbox
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from tests.utils.receiver import Receiver
from worker.upkeep.webhook_sender import Sender


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    """The module's server may call a receiver on 127.0.0.1 over http."""
    return api_settings.model_copy(update={
        "webhook_allowed_networks": ["127.0.0.1/32"],
        "webhook_allow_http": True,
        "webhook_max_endpoints_per_tenant": 5,
    })


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def send_due(api: Api) -> int:
    sender = Sender(api.maker, api.settings)
    try:
        return sender.run_once()
    finally:
        sender.close()


def register(client: httpx.Client, url: str, **body: object) -> dict:
    r = client.post("/v1/webhooks", json={"url": url, **body})
    assert r.status_code == 201, r.text
    return dict(r.json())


def test_the_secret_is_shown_once(client_a: httpx.Client, receiver: Receiver) -> None:
    created = register(client_a, receiver.url, description="ci")
    assert created["secret"].startswith("whsec_")
    assert created["event_types"] == ["job.succeeded", "job.failed", "job.cancelled"]
    got = client_a.get(f"/v1/webhooks/{created['id']}").json()
    assert got["secret"] is None and got["url"] == receiver.url and got["description"] == "ci"
    listed = client_a.get("/v1/webhooks").json()["data"]
    assert created["id"] in [w["id"] for w in listed]
    assert all(w["secret"] is None for w in listed)


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"url": "https://169.254.169.254/latest"}, "url", "link-local"),
    ({"url": "https://10.0.0.1/hook"}, "url", "private"),
    ({"url": "ftp://127.0.0.1/hook"}, "url", "https"),
    ({"url": "https://no-such-host.invalid/hook"}, "url", "does not resolve"),
    ({}, "url", "required"),
    ({"url": "http://127.0.0.1:9/x", "event_types": ["job.exploded"]}, "event_types",
     "job.exploded"),
    ({"url": "http://127.0.0.1:9/x", "event_types": []}, "event_types", "at least one"),
    ({"url": "http://127.0.0.1:9/x\x00"}, "url", "control characters"),
    ({"url": "http://127.0.0.1:9/x", "description": "a\x00b"}, "description", "NUL"),
])
def test_a_bad_registration_is_a_422_naming_the_field(
    client_a: httpx.Client, body: dict, param: str, says: str
) -> None:
    r = client_a.post("/v1/webhooks", json=body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_endpoints_belong_to_one_tenant(
    client_a: httpx.Client, client_b: httpx.Client, receiver: Receiver
) -> None:
    wh = register(client_a, receiver.url)["id"]
    for method, path in [("GET", ""), ("GET", "/deliveries"), ("POST", "/test"), ("DELETE", "")]:
        r = client_b.request(method, f"/v1/webhooks/{wh}{path}")
        assert r.status_code == 404, (method, path, r.text)
    assert wh not in [w["id"] for w in client_b.get("/v1/webhooks").json()["data"]]
    assert client_a.delete(f"/v1/webhooks/{wh}").json() == {"id": wh, "deleted": True}
    assert client_a.get(f"/v1/webhooks/{wh}").status_code == 404


def test_a_test_event_is_delivered_signed_and_listed(
    api: Api, client_a: httpx.Client, receiver: Receiver
) -> None:
    created = register(client_a, receiver.url)
    r = client_a.post(f"/v1/webhooks/{created['id']}/test")
    assert r.status_code == 202, r.text
    queued = r.json()
    assert (queued["event_type"], queued["status"], queued["attempts"]) == (
        "webhook.test", "pending", 0)
    assert send_due(api) >= 1

    (got,) = receiver.received
    payload = Webhook(created["secret"]).verify(got.body, got.headers)
    assert payload["type"] == "webhook.test" and payload["id"] == queued["event_id"]
    (listed,) = client_a.get(f"/v1/webhooks/{created['id']}/deliveries").json()["data"]
    assert listed["event_id"] == queued["event_id"]
    assert (listed["status"], listed["attempts"], listed["last_status_code"]) == (
        "delivered", 1, 200)
    assert listed["delivered_at"] is not None and listed["next_attempt_at"] is None

    metrics = httpx.get(f"{api.url}/metrics").text
    delivered = next(line for line in metrics.splitlines()
                     if line.startswith('ftune_webhook_deliveries{status="delivered"}'))
    assert float(delivered.split()[-1]) >= 1


def test_cancelling_a_job_through_the_api_sends_job_cancelled(
    api: Api, client_a: httpx.Client, receiver: Receiver
) -> None:
    created = register(client_a, receiver.url, event_types=["job.cancelled"])
    file_id = upload_rows(client_a, TEXT_ROWS)
    job = client_a.post("/v1/jobs", json=job_body(file_id)).json()
    assert client_a.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
    send_due(api)

    mine = [r for r in receiver.received if r.json()["data"].get("id") == job["id"]]
    assert [r.json()["type"] for r in mine] == ["job.cancelled"]
    payload = Webhook(created["secret"]).verify(mine[0].body, mine[0].headers)
    assert payload["data"]["status"] == "cancelled" and payload["data"]["object"] == "job"
    # What is sent is what the OpenAPI document describes, field for field.
    documented = WebhookPayload.model_validate(payload)
    assert set(payload["data"]) | {"checkpoint"} == set(JobSummary.model_fields)
    assert documented.data.id == job["id"]


def test_the_events_sent_are_documented_as_openapi_webhooks(api: Api) -> None:
    doc = httpx.get(f"{api.url}/openapi.json").json()
    assert set(doc["webhooks"]) == {*outbox.EVENT_TYPES, outbox.TEST_EVENT}
    body = doc["webhooks"]["job.succeeded"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/WebhookPayload")


def test_the_number_of_endpoints_is_bounded(client_b: httpx.Client, receiver: Receiver) -> None:
    for _ in range(5):
        register(client_b, receiver.url)
    r = client_b.post("/v1/webhooks", json={"url": receiver.url})
    assert r.status_code == 409 and "delete one" in r.json()["error"]["message"]


def test_pausing_and_resuming_a_job_sends_job_paused_then_job_resumed(
    api: Api, client_a: httpx.Client, receiver: Receiver
) -> None:
    register(client_a, receiver.url, event_types=["job.paused", "job.resumed"])
    file_id = upload_rows(client_a, TEXT_ROWS)
    job = client_a.post("/v1/jobs", json=job_body(file_id)).json()
    assert client_a.post(f"/v1/jobs/{job['id']}/pause").json()["status"] == "paused"
    assert client_a.post(f"/v1/jobs/{job['id']}/resume").json()["status"] == "queued"
    send_due(api)

    mine = [r.json() for r in receiver.received if r.json()["data"].get("id") == job["id"]]
    assert [(p["type"], p["data"]["status"]) for p in mine] == [
        ("job.paused", "paused"), ("job.resumed", "queued")]
