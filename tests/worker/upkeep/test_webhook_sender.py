"""The webhook outbox and sender against a real local receiver: events commit with the
status change, signatures verify with the standardwebhooks package, a receiver that was
down gets every event, a sender that dies loses nothing, and a retry reuses the event id.
Retry timings are milliseconds here (settings)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks import Webhook

from core.db.models import (
    DeliveryStatus,
    JobStatus,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    utcnow,
)
from core.db.session import get_sessionmaker, session_scope
from core.infra.settings import Settings
from core.jobs import state as jobstate
from core.webhooks import outbox
from testkit.wait import wait_until
from tests.utils.receiver import Receiver
from tests.utils.worker import WorkerEnv, fake_job, make_job, make_tenant
from worker.upkeep.webhook_sender import Sender, start_thread

FAST = {
    "FTUNE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32",
    "FTUNE_WEBHOOK_ALLOW_HTTP": "true",
    "FTUNE_WEBHOOK_RETRY_BASE_SECONDS": "0.02",
    "FTUNE_WEBHOOK_RETRY_MAX_INTERVAL_SECONDS": "0.1",
    "FTUNE_WEBHOOK_POLL_SECONDS": "0.02",
    "FTUNE_WEBHOOK_TIMEOUT_SECONDS": "2",
    "FTUNE_WEBHOOK_LEASE_SECONDS": "5",
}


@pytest.fixture(scope="module")
def own_pg_url() -> Iterator[str]:
    """A database of this module's own: no other test's sender may take our deliveries."""
    from testkit.pg import migrated_database

    with migrated_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest, sqlite_url: str) -> str:
    return sqlite_url if request.param == "sqlite" else str(request.getfixturevalue("own_pg_url"))


@pytest.fixture
def henv(tmp_path: Path, configure, sqlite_url: str) -> WorkerEnv:  # type: ignore[no-untyped-def]
    return configure(tmp_path, sqlite_url, **FAST)


@pytest.fixture
def henv_any(tmp_path: Path, configure, any_db: str) -> WorkerEnv:  # type: ignore[no-untyped-def]
    return configure(tmp_path, any_db, **FAST)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def add_endpoint(tenant_id: str, url: str,
                 types: tuple[str, ...] = outbox.JOB_EVENT_TYPES) -> str:
    with session_scope() as s:
        e = WebhookEndpoint(tenant_id=tenant_id, url=url, event_types=list(types),
                            secret=outbox.new_secret())
        s.add(e)
        s.flush()
        return e.id


def secret_of(endpoint_id: str) -> str:
    with session_scope() as s:
        return s.get_one(WebhookEndpoint, endpoint_id).secret


def run_to_success(job_id: str) -> None:
    """queued -> running -> succeeded, as a worker's moves would."""
    now = utcnow()
    with session_scope() as s:
        assert jobstate.claim(s, job_id, worker_id="w1", max_attempts=3, now=now)
    with session_scope() as s:
        assert jobstate.finish(s, job_id, jobstate.Holder("w1", 1), previous=JobStatus.running,
                               to=JobStatus.succeeded, now=utcnow(), adapter_path="/x")


def deliveries(endpoint_id: str | None = None) -> list[WebhookDelivery]:
    with session_scope() as s:
        q = select(WebhookDelivery).order_by(WebhookDelivery.id)
        if endpoint_id is not None:
            q = q.where(WebhookDelivery.endpoint_id == endpoint_id)
        rows = list(s.scalars(q))
        s.expunge_all()
        return rows


def event_ids(endpoint_id: str) -> set[str]:
    return {d.event_id for d in deliveries(endpoint_id)}


def sender(settings: Settings, **overrides: object) -> Sender:
    maker: sessionmaker[Session] = get_sessionmaker()
    return Sender(maker, settings.model_copy(update=overrides))


def drain(s: Sender, until: float = 10.0) -> None:
    """Run passes until nothing is pending (retries included)."""

    def drained() -> bool:
        while any(d.status == DeliveryStatus.pending for d in deliveries()):
            if not s.run_once():
                return False  # a retry not yet due
        return True

    wait_until(drained, until, "no delivery left pending", every=0.02)


# ----------------------------------------------------------------------------- the outbox


def test_the_event_commits_with_the_move_or_not_at_all(henv: WorkerEnv) -> None:
    tenant = make_tenant()
    job_id = make_job({"name": "x"}, tenant_id=tenant)
    listening = add_endpoint(tenant, "http://127.0.0.1:9/a", ("job.running",))
    add_endpoint(tenant, "http://127.0.0.1:9/b", ("job.succeeded",))  # not subscribed
    add_endpoint(make_tenant(), "http://127.0.0.1:9/c")  # another tenant's

    with pytest.raises(RuntimeError), session_scope() as s:
        assert jobstate.claim(s, job_id, worker_id="w1", max_attempts=3, now=utcnow())
        raise RuntimeError("the transaction fails after the move")
    with session_scope() as s:
        assert s.scalar(select(func.count(WebhookEvent.id))) == 0

    with session_scope() as s:
        assert jobstate.claim(s, job_id, worker_id="w1", max_attempts=3, now=utcnow())
    with session_scope() as s:
        event = s.scalars(select(WebhookEvent)).one()
        assert event.type == "job.running" and event.tenant_id == tenant
        assert event.payload["id"] == event.id
        assert event.payload["data"]["id"] == job_id
        assert event.payload["data"]["status"] == "running"
        assert event.payload["data"]["attempt"] == 1
    assert [d.endpoint_id for d in deliveries()] == [listening]


def test_a_worker_run_sends_running_checkpoints_and_succeeded(
    henv: WorkerEnv, direct: None, receiver: Receiver
) -> None:
    from tests.utils.worker import get_job
    from worker.run.local import run_job

    job_id = fake_job(henv)
    endpoint = add_endpoint(get_job(job_id).tenant_id, receiver.url)
    assert run_job(job_id) == JobStatus.succeeded
    drain(sender(henv.settings))
    types = [r.json()["type"] for r in receiver.received]
    assert types[0] == "job.running" and types[-1] == "job.succeeded"
    assert "job.checkpoint" in types
    checkpoint = next(r.json() for r in receiver.received if r.json()["type"] == "job.checkpoint")
    assert checkpoint["data"]["checkpoint"]["step"] > 0
    assert all(d.status == DeliveryStatus.delivered for d in deliveries(endpoint))


# ----------------------------------------------------------------------------- sending


def test_deliveries_are_signed_as_standard_webhooks(henv: WorkerEnv, receiver: Receiver) -> None:
    tenant = make_tenant()
    job_id = make_job({"name": "x"}, tenant_id=tenant)
    endpoint = add_endpoint(tenant, receiver.url)
    run_to_success(job_id)
    drain(sender(henv.settings))

    assert len(receiver.received) == 2
    wh = Webhook(secret_of(endpoint))
    for r in receiver.received:
        payload = wh.verify(r.body, r.headers)  # raises if the signature is wrong
        assert payload["id"] == r.headers["webhook-id"]
        assert payload["data"]["id"] == job_id
        assert r.headers["content-type"] == "application/json"
    with pytest.raises(Exception, match="signature"):
        Webhook(outbox.new_secret()).verify(receiver.received[0].body, receiver.received[0].headers)
    assert [r.json()["type"] for r in receiver.received] == ["job.running", "job.succeeded"]
    done = deliveries(endpoint)
    assert [(d.status, d.attempts, d.last_status_code) for d in done] == [
        (DeliveryStatus.delivered, 1, 200)] * 2
    assert all(d.delivered_at is not None for d in done)


def test_a_receiver_down_for_a_while_gets_every_event_after_it_returns(
    henv_any: WorkerEnv,
) -> None:
    receiver = Receiver().start()
    receiver.stop()  # its port now refuses connections
    tenant = make_tenant()
    endpoint = add_endpoint(tenant, receiver.url)
    jobs = [make_job({"name": f"j{i}"}, tenant_id=tenant) for i in range(3)]
    stop = threading.Event()
    thread = start_thread(get_sessionmaker(), henv_any.settings, stop)
    try:
        for job_id in jobs:
            run_to_success(job_id)
        expected = event_ids(endpoint)
        assert len(expected) == 6
        wait_until(lambda: min(d.attempts for d in deliveries(endpoint)) >= 3, 10,
                   "three attempts at each delivery", every=0.05)
        down = deliveries(endpoint)
        assert all(d.status == DeliveryStatus.pending and d.last_status_code is None
                   and d.last_error for d in down)

        receiver.start()  # back, on the same port
        receiver.wait_for(lambda r: set(r.ids()) == expected)
        wait_until(lambda: all(d.status == DeliveryStatus.delivered for d in deliveries(endpoint)),
                   10, "every delivery delivered", every=0.05)
    finally:
        stop.set()
        thread.join(5)
        receiver.stop()
    # Each event once, under its own id, with one body whatever the attempt.
    assert sorted(receiver.ids()) == sorted(expected)
    assert {r.json()["id"] for r in receiver.received} == expected


def test_a_sender_that_dies_loses_nothing_and_resends_under_the_same_id(
    henv: WorkerEnv, receiver: Receiver
) -> None:
    tenant = make_tenant()
    endpoint = add_endpoint(tenant, receiver.url, ("job.running", "job.succeeded"))
    for i in range(2):
        run_to_success(make_job({"name": f"j{i}"}, tenant_id=tenant))
    lease = 1.0
    dying = sender(henv.settings, webhook_lease_seconds=lease)
    restarted = sender(henv.settings, webhook_lease_seconds=lease)
    claimed = dying.claim()
    assert len(claimed) == 4
    dying.attempt(claimed[0])  # sent, then the process dies before recording it
    dying.close()
    assert len(receiver.received) == 1

    assert restarted.claim() == [], "a live lease is not taken over"
    time.sleep(lease + 0.05)
    drain(restarted)

    ids = receiver.ids()
    assert set(ids) == event_ids(endpoint)
    assert ids.count(claimed[0].event_id) == 2  # at least once: the same id again
    assert len(ids) == 5  # and nothing else twice
    assert all(d.status == DeliveryStatus.delivered for d in deliveries(endpoint))


def test_concurrent_senders_never_claim_the_same_delivery(henv_any: WorkerEnv) -> None:
    tenant = make_tenant()
    endpoint = add_endpoint(tenant, "http://127.0.0.1:9/never-called")
    with session_scope() as s:
        for i in range(60):
            outbox.record(s, tenant, "job.succeeded", {"n": i}, [endpoint])
    senders = [sender(henv_any.settings) for _ in range(3)]
    got: list[list[int]] = [[] for _ in senders]
    start = threading.Barrier(len(senders))

    def claim_all(i: int) -> None:
        start.wait()
        while batch := senders[i].claim(limit=5):
            got[i].extend(c.delivery_id for c in batch)

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(len(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    flat = [d for g in got for d in g]
    assert len(flat) == len(set(flat)) == 60
    assert sorted(flat) == [d.id for d in deliveries(endpoint)]


def test_a_delivery_failing_past_the_retry_window_is_failed(
    henv: WorkerEnv, receiver: Receiver
) -> None:
    receiver.status = 500
    tenant = make_tenant()
    endpoint = add_endpoint(tenant, receiver.url, ("job.succeeded",))
    run_to_success(make_job({"name": "x"}, tenant_id=tenant))
    drain(sender(henv.settings, webhook_retry_window_seconds=0.5))
    (d,) = deliveries(endpoint)
    assert d.status == DeliveryStatus.failed
    assert d.attempts >= 2 and d.attempts == len(receiver.received)  # retried, then gave up
    assert (d.last_status_code, d.last_error) == (500, "HTTP 500")
    assert len(set(receiver.ids())) == 1


def test_redirects_are_not_followed(henv: WorkerEnv, receiver: Receiver) -> None:
    elsewhere = Receiver().start()
    try:
        receiver.status, receiver.location = 307, elsewhere.url
        tenant = make_tenant()
        endpoint = add_endpoint(tenant, receiver.url, ("job.succeeded",))
        run_to_success(make_job({"name": "x"}, tenant_id=tenant))
        assert sender(henv.settings).run_once() == 1
        (d,) = deliveries(endpoint)
        assert d.status == DeliveryStatus.pending and d.last_status_code == 307
        assert d.last_error is not None and "not followed" in d.last_error
        assert len(receiver.received) == 1 and elsewhere.received == []
    finally:
        elsewhere.stop()


def test_an_address_the_operator_does_not_allow_is_never_called(
    henv: WorkerEnv, receiver: Receiver
) -> None:
    tenant = make_tenant()
    endpoint = add_endpoint(tenant, receiver.url, ("job.succeeded",))  # stored while allowed
    run_to_success(make_job({"name": "x"}, tenant_id=tenant))
    assert sender(henv.settings, webhook_allowed_networks=[]).run_once() == 1
    (d,) = deliveries(endpoint)
    assert d.status == DeliveryStatus.pending and d.last_status_code is None
    assert d.last_error is not None and "loopback" in d.last_error
    assert receiver.received == []


def test_old_events_with_nothing_to_retry_are_pruned(henv_any: WorkerEnv) -> None:
    from datetime import timedelta

    from sqlalchemy import update

    tenant = make_tenant()
    endpoint = add_endpoint(tenant, "http://127.0.0.1:9/x")
    old = utcnow() - timedelta(days=31)
    with session_scope() as s:
        done = outbox.record(s, tenant, "job.succeeded", {}, [endpoint], now=old).id
        retrying = outbox.record(s, tenant, "job.failed", {}, [endpoint], now=old).id
        fresh = outbox.record(s, tenant, "job.cancelled", {}, [endpoint]).id
        s.execute(update(WebhookDelivery).where(WebhookDelivery.event_id.in_([done, fresh]))
                  .values(status=DeliveryStatus.delivered))
    assert sender(henv_any.settings).prune() == 1
    with session_scope() as s:
        left = set(s.scalars(select(WebhookEvent.id).where(WebhookEvent.tenant_id == tenant)))
    assert left == {retrying, fresh}
    assert {d.event_id for d in deliveries(endpoint)} == {retrying, fresh}


# ----------------------------------------------------------------------------- TLS


def _tls_receiver(tmp: Path, name: str) -> tuple[Receiver, Path]:
    """An https receiver on 127.0.0.1 whose self-signed certificate names ``name``."""
    import ssl
    import subprocess

    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}"], check=True, capture_output=True)
    receiver = Receiver().start()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    assert receiver._server is not None
    receiver._server.socket = context.wrap_socket(receiver._server.socket, server_side=True)
    return receiver, cert


@pytest.mark.parametrize(("certified", "delivered"), [("hooks.test", True),
                                                      ("other.test", False)])
def test_tls_is_verified_for_the_name_while_connecting_to_the_checked_address(
    henv: WorkerEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, certified: str,
    delivered: bool,
) -> None:
    import ipaddress
    import ssl

    from core.infra import netguard

    receiver, cert = _tls_receiver(tmp_path, certified)
    looked_up: list[str] = []

    def resolve(host: str, port: int) -> list[netguard.IPAddress]:
        looked_up.append(host)
        return [ipaddress.ip_address("127.0.0.1")]

    monkeypatch.setattr(netguard, "resolve", resolve)
    try:
        tenant = make_tenant()
        endpoint = add_endpoint(tenant, f"https://hooks.test:{receiver.port}/in",
                                ("job.succeeded",))
        run_to_success(make_job({"name": "x"}, tenant_id=tenant))
        s = Sender(get_sessionmaker(), henv.settings,
                   verify=ssl.create_default_context(cafile=str(cert)))
        assert s.run_once() == 1
        (d,) = deliveries(endpoint)
        assert looked_up == ["hooks.test"]  # once, by the check; the POST went to its answer
        if delivered:
            assert d.status == DeliveryStatus.delivered
            (got,) = receiver.received
            assert got.headers["host"] == f"hooks.test:{receiver.port}"
        else:
            assert d.status == DeliveryStatus.pending and d.last_error is not None
            assert "CERTIFICATE_VERIFY_FAILED" in d.last_error or "certificate" in d.last_error
            assert receiver.received == []
    finally:
        receiver.stop()
