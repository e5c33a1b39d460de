"""The fault suite's bar with several jobs per worker: one worker with two simulated GPUs
runs two fake-trainer jobs side by side; the worker and every trainer process are SIGKILLed
mid-run and the worker restarted. No job is lost or run twice at once, no GPU is held by two
jobs, no process is left, and the dead worker's GPUs are freed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
    PgDatabase,
    RedisServer,
    launch_processes,
    send_run_job,
    sigkill,
)
from testkit.wait import wait_until
from tests.utils.tiny import text_rows, write_jsonl

pytestmark = pytest.mark.e2e

QUEUE = "ftune.fleet-faults"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    redis = RedisServer(tmp_path_factory.mktemp("redis")).start()
    db = PgDatabase().create()
    models = tmp_path_factory.mktemp("models")
    (models / "m").mkdir()
    (models / "m" / "config.json").write_text("{}")
    st = FaultStack(
        data_dir=tmp_path_factory.mktemp("fleet-faults"),
        workers=1,
        env_overrides={
            "DATABASE_URL": db.url,
            "BROKER_URL": redis.url,
            "FTUNE_QUEUE_NAME": QUEUE,
            "FTUNE_ALLOWED_MODEL_ROOTS": str(models),
            "FTUNE_TRAINER_MODULE": "testkit.fake_trainer",
            "FTUNE_FAKE_GPUS": "2",
            "FAKE_STEP_SECONDS": "0.1",
            "FTUNE_HEARTBEAT_SECONDS": "0.5",
            "FTUNE_HEARTBEAT_TIMEOUT_SECONDS": "4",
            "FTUNE_RECONCILE_INTERVAL_SECONDS": "1",
            "FTUNE_QUEUED_REQUEUE_SECONDS": "3",
            "FTUNE_CANCEL_GRACE_SECONDS": "3",
            "FTUNE_MAX_ATTEMPTS": "3",
        },
    )
    st.start()
    yield st
    st.stop()
    db.drop()
    redis.stop()


def fleet(stack: FaultStack) -> list[dict[str, Any]]:
    """GET /v1/workers with the stack's bootstrap key (an admin key)."""
    r = httpx.get(f"{stack.url}/v1/workers",
                  headers={"Authorization": f"Bearer {stack.api_key}"}, timeout=30)
    r.raise_for_status()
    return list(r.json()["data"])


def events(c: FtuneClient, job_id: str, type_: str) -> list[dict[str, Any]]:
    return [e for e in c.events(job_id, limit=1000) if e["type"] == type_]


def test_worker_sigkilled_with_two_jobs_on_its_gpus_loses_none_and_double_books_none(
        stack: FaultStack, tmp_path: Path) -> None:
    with FtuneClient(stack.url, stack.api_key) as c:
        data = c.upload_file(write_jsonl(tmp_path / "train.jsonl", text_rows(16)))["id"]
        spec = {"name": "fake:train", "model": {"name_or_path": str(stack.env_overrides[
                    "FTUNE_ALLOWED_MODEL_ROOTS"]) + "/m"},
                "dataset": {"file_id": data, "format": "text"},
                "training": {"max_steps": 80, "save_steps": 5}}
        ids = [c.create_job(spec)["id"] for _ in range(2)]
        send_run_job(stack.env_overrides["BROKER_URL"], ids[0], 2, queue=QUEUE)  # duplicates

        def both_training() -> bool:
            jobs = [c.get_job(i) for i in ids]
            return all(j["status"] == "running" and j["progress"]["step"] >= 6 for j in jobs)

        wait_until(both_training, 90, "both jobs to train side by side")
        [worker] = fleet(stack)
        assert sorted(g["job_id"] for g in worker["gpus"]) == sorted(ids)
        procs = set().union(*(launch_processes(i, 1) for i in ids))
        assert procs

        stack.kill_worker(0)
        sigkill(procs)
        stack.start_worker(0)

        for job_id in ids:
            job = c.wait(job_id, timeout=120, poll_seconds=0.5)
            assert job["status"] == "succeeded", job["error"]
            assert job["attempt"] == 2
            started = events(c, job_id, "started")
            assert [s["data"]["attempt"] for s in started] == [1, 2]
            assert started[1]["data"]["resumed_from"].startswith("checkpoints/checkpoint-")
            wait_until(lambda j=job_id: not launch_processes(j), 10, "no process left")
        placements = [json.loads((stack.data_dir / "jobs" / i / "placement.json").read_text())
                      for i in ids]
        assert sorted(p["gpu_ids"][0] for p in placements) == [0, 1]  # attempt 2, side by side
        workers = {w["id"]: w for w in fleet(stack)}
        assert all(g["job_id"] is None for w in workers.values() for g in w["gpus"])
        assert sorted(w["state"] for w in workers.values()) == ["active", "lost"]
