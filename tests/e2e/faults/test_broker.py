"""The broker and the API as they fail: messages flushed or lost with a Redis restart,
delivered three times, outliving the visibility timeout; the API killed while clients submit
with idempotency keys. Each job still runs exactly once."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import httpx
import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
    PgDatabase,
    RedisServer,
    send_run_job,
)
from testkit.wait import wait_until
from tests.utils.faults import (
    QUEUE,
    TERMINAL,
    events,
    fake_spec,
    log_count,
    plant_unacked,
    timestamp,
    wait_all,
)

pytestmark = pytest.mark.e2e


def test_messages_lost_by_redis_flushall_and_restart_are_sent_again(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    r = redis_server.client()
    busy = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", f"busy{i}",
                                        max_steps=15))["id"] for i in range(2)]
    wait_until(lambda: all(client.get_job(b)["status"] == "running" for b in busy), 60,
               "both workers busy")
    flushed = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "succeed", "flushed"))["id"]]
    assert r.llen(QUEUE) >= 1
    redis_server.flushall()
    assert r.llen(QUEUE) == 0
    crashed = [client.create_job(fake_spec(tiny_causal_lm, lm_file, "succeed", "crashed"))["id"]]
    assert r.llen(QUEUE) >= 1
    redis_server.restart()  # SIGKILL, no persistence: an empty broker comes back
    assert redis_server.client().llen(QUEUE) == 0

    jobs = wait_all(client, busy + flushed + crashed, 90)
    assert {j["status"] for j in jobs.values()} == {"succeeded"}, jobs
    assert {j["attempt"] for j in jobs.values()} == {1}
    for job_id in flushed + crashed:
        resent = [e for e in events(client, job_id, "requeued")
                  if e["data"].get("reason") == "queued_timeout"]
        assert resent, f"{job_id} ran without the reconciler sending it again?"
        assert len(events(client, job_id, "started")) == 1
    assert stack.alive_workers() == [0, 1], "the workers rode out the Redis restart"


def test_a_message_delivered_three_times_starts_one_run(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    job_id = client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", max_steps=8))["id"]
    send_run_job(redis_server.url, job_id, 2, queue=QUEUE)  # both workers get one at the same time

    job = client.wait(job_id, timeout=60, poll_seconds=0.3)
    assert job["status"] == "succeeded" and job["attempt"] == 1
    assert len(events(client, job_id, "started")) == 1
    running = [e for e in events(client, job_id, "status") if e["data"]["status"] == "running"]
    assert len(running) == 1
    wait_until(lambda: log_count(stack, f"job {job_id} is ") >= 2, 20, "both duplicates seen")
    assert log_count(stack, f"job {job_id}: claimed attempt") == 1


def test_a_run_longer_than_the_visibility_timeout_is_delivered_once(
        stack: FaultStack, client: FtuneClient, redis_server: RedisServer,
        tiny_causal_lm: Path, lm_file: str) -> None:
    """visibility_timeout is 2 s, swept every second; the run takes ~9 s. Messages are acked
    on receipt, so nothing of this job is left unacked to come back. Control: an unacked
    message planted in the same Redis *is* given back and delivered by these workers."""
    r = redis_server.client()
    job_id = client.create_job(fake_spec(tiny_causal_lm, lm_file, "train", max_steps=25))["id"]
    wait_until(lambda: client.get_job(job_id)["status"] == "running", 60, "running")
    planted = plant_unacked(redis_server, f"job-planted-{secrets.token_hex(3)}")

    seen_unacked: list[bytes] = []
    while (status := client.get_job(job_id)["status"]) not in TERMINAL:
        seen_unacked += [v for v in r.hvals("unacked") if job_id.encode() in v]
        time.sleep(0.2)
    assert status == "succeeded"
    job = client.get_job(job_id)
    run_seconds = (timestamp(job["finished_at"]) - timestamp(job["started_at"]))
    assert run_seconds > 3 * 2, "the run must outlast the visibility timeout several times"
    assert seen_unacked == [], "the job's message was left unacked while it ran"
    wait_until(lambda: log_count(stack, f"job {planted}: no such job") >= 1, 15,
               "the planted unacked message to be restored and delivered (control)")
    assert job["attempt"] == 1 and len(events(client, job_id, "started")) == 1
    assert log_count(stack, f"job {job_id}: claimed attempt") == 1
    assert log_count(stack, f"job {job_id} is ") == 0, "delivered again"






def test_api_killed_during_submissions_retried_keys_make_one_job_each(
        stack: FaultStack, client: FtuneClient, database: PgDatabase,
        tiny_causal_lm: Path, lm_file: str) -> None:
    from sqlalchemy import create_engine, text

    label = secrets.token_hex(4)
    spec = fake_spec(tiny_causal_lm, lm_file, "succeed", label)
    keys = [f"{label}-{i}" for i in range(24)]
    answered: dict[str, str] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def submit(my_keys: list[str]) -> None:
        with httpx.Client(base_url=stack.url, timeout=5,
                          headers={"Authorization": f"Bearer {stack.api_key}"}) as http:
            for k in my_keys:
                try:
                    resp = http.post("/v1/jobs", json=spec, headers={"Idempotency-Key": k})
                    resp.raise_for_status()
                    with lock:
                        answered[k] = resp.json()["id"]
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"{k}: {type(e).__name__}")
                time.sleep(0.05)

    threads = [threading.Thread(target=submit, args=(keys[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: len(answered) >= 6, 30, "some submissions")
    stack.kill_api()  # mid-stream: requests in flight die with it
    for t in threads:
        t.join()
    stack.start_api()

    final: dict[str, str] = {}
    for k in keys:  # every client retries with its key
        final[k] = client.create_job(spec, idempotency_key=k)["id"]
    assert errors, "the API died before every request was answered"
    assert all(final[k] == answered[k] for k in answered), "a retry made a second job"
    engine = create_engine(database.url)
    try:
        with engine.connect() as conn:
            n, n_keys = conn.execute(text(
                "SELECT count(*), count(DISTINCT idempotency_key) FROM jobs WHERE name = :n"),
                {"n": spec["name"]}).one()
    finally:
        engine.dispose()
    assert n == n_keys == len(keys) == len(set(final.values()))
    for job_id in set(final.values()):  # the workers need not run them all
        client.cancel_job(job_id)
    wait_all(client, list(set(final.values())), 60)
