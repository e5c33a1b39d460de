"""Webhooks through real processes, in the embedded shape `ftune up` runs (SQLite, the
filesystem broker, the API and a Celery worker whose thread sends webhooks), with the fake
trainer under `accelerate launch` and a real local receiver."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select
from standardwebhooks import Webhook

from client import FtuneClient
from core.db.models import WebhookEvent
from testkit.faultstack import FaultStack
from testkit.wait import wait_until
from tests.utils.receiver import Receiver
from tests.utils.tiny import text_rows, write_jsonl

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models_dir: Path,
          tiny_causal_lm: Path) -> Iterator[FaultStack]:
    data_dir = tmp_path_factory.mktemp("hooks")
    st = FaultStack(
        data_dir=data_dir,
        workers=1,
        env_overrides={
            "DATABASE_URL": f"sqlite:///{data_dir / 'ftune.db'}",
            "BROKER_URL": "filesystem://",
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models_dir),
            "FTUNE_TRAINER_MODULE": "testkit.fake_trainer",
            "FTUNE_WORKER_GPUS": "0",
            "FTUNE_HEARTBEAT_SECONDS": "0.5",
            "FTUNE_CANCEL_GRACE_SECONDS": "5",
            "FTUNE_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.1/32",
            "FTUNE_WEBHOOK_ALLOW_HTTP": "true",
            "FTUNE_WEBHOOK_RETRY_BASE_SECONDS": "0.05",
            "FTUNE_WEBHOOK_RETRY_MAX_INTERVAL_SECONDS": "0.2",
            "FTUNE_WEBHOOK_POLL_SECONDS": "0.05",
            "FTUNE_WEBHOOK_TIMEOUT_SECONDS": "2",
            "FTUNE_WEBHOOK_LEASE_SECONDS": "3",
        },
    )
    st.start()
    yield st
    st.stop()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def file_id(stack: FaultStack, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = write_jsonl(tmp_path_factory.mktemp("upload") / "train.jsonl", text_rows(16))
    with FtuneClient(stack.url, stack.api_key) as c:
        return str(c.upload_file(path)["id"])


def register(stack: FaultStack, url: str, types: list[str]) -> dict[str, Any]:
    with FtuneClient(stack.url, stack.api_key) as c:
        return c.create_webhook(url, event_types=types)


def submit(stack: FaultStack, model: Path, file_id: str, mode: str) -> str:
    spec = {"name": f"fake:{mode}", "model": {"name_or_path": str(model), "task": "causal_lm"},
            "dataset": {"file_id": file_id, "format": "text", "max_seq_length": 32},
            "training": {"max_steps": 8}}
    with FtuneClient(stack.url, stack.api_key) as c:
        return str(c.create_job(spec)["id"])


def wait_job(stack: FaultStack, job_id: str) -> dict[str, Any]:
    with FtuneClient(stack.url, stack.api_key) as c:
        return dict(c.wait(job_id, poll_seconds=0.2, timeout=120))


def of_job(receiver: Receiver, job_id: str) -> list[dict[str, Any]]:
    return [r.json() for r in receiver.received if r.json()["data"].get("id") == job_id]


def test_a_job_through_the_api_sends_running_then_succeeded(
    stack: FaultStack, receiver: Receiver, tiny_causal_lm: Path, file_id: str
) -> None:
    hook = register(stack, receiver.url, ["job.running", "job.succeeded"])
    job_id = submit(stack, tiny_causal_lm, file_id, "succeed")
    assert wait_job(stack, job_id)["status"] == "succeeded"
    receiver.wait_for(lambda r: len(of_job(r, job_id)) == 2, timeout=20)
    assert [e["type"] for e in of_job(receiver, job_id)] == ["job.running", "job.succeeded"]
    for r in receiver.received:
        Webhook(hook["secret"]).verify(r.body, r.headers)
    assert of_job(receiver, job_id)[-1]["data"]["adapter_available"] is True


def test_cancelling_a_running_job_sends_job_cancelled(
    stack: FaultStack, receiver: Receiver, tiny_causal_lm: Path, file_id: str
) -> None:
    register(stack, receiver.url, ["job.running", "job.cancelled"])
    job_id = submit(stack, tiny_causal_lm, file_id, "slow")
    receiver.wait_for(lambda r: len(of_job(r, job_id)) == 1, timeout=60)  # job.running
    with FtuneClient(stack.url, stack.api_key) as c:
        c.cancel_job(job_id)
    assert wait_job(stack, job_id)["status"] == "cancelled"
    receiver.wait_for(lambda r: len(of_job(r, job_id)) == 2, timeout=20)
    assert [e["type"] for e in of_job(receiver, job_id)] == ["job.running", "job.cancelled"]


def test_a_killed_sender_loses_nothing(stack: FaultStack) -> None:
    receiver = Receiver().start()
    receiver.stop()  # down: every attempt fails until it returns
    hook = register(stack, receiver.url, ["job.succeeded"])
    with FtuneClient(stack.url, stack.api_key) as c:  # the same outbox as job events
        queued = [c.test_webhook(hook["id"])["event_id"] for _ in range(3)]
        wait_until(lambda: min(d["attempts"] for d in c.webhook_deliveries(hook["id"])) >= 2,
                   20, "the sender to retry while the receiver is down", every=0.1)
    stack.kill_worker(0)  # SIGKILL: the sender thread dies with whatever it held
    receiver.start()
    try:
        time.sleep(0.5)
        assert receiver.received == [], "no sender runs while the worker is down"
        stack.start_worker(0)
        receiver.wait_for(lambda r: set(r.ids()) == set(queued), timeout=30)
    finally:
        receiver.stop()
    engine = create_engine(stack.env_overrides["DATABASE_URL"])
    with engine.connect() as conn:
        recorded = set(conn.scalars(select(WebhookEvent.id)))
    engine.dispose()
    assert set(receiver.ids()) <= recorded  # only under the events' own ids
    for r in receiver.received:
        Webhook(hook["secret"]).verify(r.body, r.headers)
