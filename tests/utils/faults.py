"""What the fault tests share (tests/e2e/faults/: one stack for the package, conftest.py):
the stack's timing settings and the bounds derived from them, job specs for the fake and the
real trainer with a fault injected (tests/worker/fault_trainer.py), and the waits and reads
the scenarios make of the stack."""

from __future__ import annotations

import json
import secrets
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from client import FtuneClient
from testkit.faultstack import FaultStack, RedisServer, launch_processes
from testkit.wait import wait_until
from tests.utils.specs import spec_body

HEARTBEAT_TIMEOUT = 4.0
RECONCILE_INTERVAL = 1.0
GRACE = 3.0
ORPHAN_GRACE = max(1.0, min(GRACE, HEARTBEAT_TIMEOUT / 2))  # what the worker gives the trainer
MAX_ATTEMPTS = 2
# A lost worker is noticed after the heartbeat timeout, by the next reconciler pass (every
# interval, +-20% jitter); a second of slack for a loaded machine.
DETECTION_BOUND = HEARTBEAT_TIMEOUT + 1.2 * RECONCILE_INTERVAL + 0.5 + 3.0
QUEUE = "ftune.faults"
TERMINAL = ("succeeded", "failed", "cancelled")


def fake_spec(model: Path, file_id: str, mode: str, label: str = "",
              **training: Any) -> dict[str, Any]:
    return {"name": f"fake:{mode}" + (f":{label}" if label else ""),
            **spec_body(model, task="causal_lm",
                        dataset={"file_id": file_id, "format": "text", "max_seq_length": 32},
                        training=training or {"max_steps": 20})}


def real_spec(model: Path, dataset: dict[str, Any], fault: str, **training: Any) -> dict[str, Any]:
    return {"name": f"fault:{fault}",
            **spec_body(model, task="causal_lm",
                        dataset={"format": "text", "max_seq_length": 32, **dataset},
                        peft={"method": "lora", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
                        training={"max_steps": 6, "learning_rate": 5e-3,
                                  "per_device_train_batch_size": 4, "logging_steps": 1,
                                  "save_steps": 2, "seed": 0, **training})}


def events(c: FtuneClient, job_id: str, type_: str | None = None) -> list[dict[str, Any]]:
    evs = c.events(job_id, limit=1000)
    return [e for e in evs if type_ is None or e["type"] == type_]


def holder(c: FtuneClient, job_id: str) -> str:
    """The worker_id of the job's latest claim (from its "running" status event)."""
    running = [e for e in events(c, job_id, "status") if e["data"].get("status") == "running"]
    return str(running[-1]["data"]["worker_id"])


def job_dir(stack: FaultStack, job_id: str) -> Path:
    return stack.data_dir / "jobs" / job_id


def trainer_step(jd: Path) -> int:
    """The last step the trainer reported in events.jsonl (the DB lags by a poll)."""
    from core.run.jobdir import read_events

    steps = [e["step"] for _, e in read_events(jd / "events.jsonl") if e["type"] == "progress"]
    return max(steps, default=0)


def assert_no_process_left(job_id: str, timeout: float = 10.0) -> None:
    wait_until(lambda: not launch_processes(job_id), timeout,
               f"every process of job {job_id} to be gone")


def wait_all(c: FtuneClient, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    jobs: dict[str, dict[str, Any]] = {}

    def done() -> bool:
        for i in ids:
            if i not in jobs or jobs[i]["status"] not in TERMINAL:
                jobs[i] = c.get_job(i)
        return all(j["status"] in TERMINAL for j in jobs.values())

    wait_until(done, timeout, f"jobs to finish: {ids}", every=0.5)
    return jobs


def log_count(stack: FaultStack, needle: str) -> int:
    return sum(stack.worker_log(i).read_text(errors="replace").count(needle)
               for i in range(stack.workers) if stack.worker_log(i).exists())


def block_workers(c: FtuneClient, model: Path, file_id: str, stack: FaultStack) -> list[str]:
    """Occupy both workers with jobs that "load the model" until cancelled."""
    ids = [c.create_job(fake_spec(model, file_id, "slow_load", f"b{i}"))["id"]
           for i in range(stack.workers)]
    wait_until(lambda: all(events(c, i, "log") for i in ids), 60, "both workers busy loading")
    return ids


def release(c: FtuneClient, blockers: list[str]) -> None:
    """Cancel while the model loads: cancelled, and nothing of theirs left running."""
    for b in blockers:
        assert c.cancel_job(b)["status"] == "cancelling"
    for b, job in wait_all(c, blockers, 30).items():
        assert job["status"] == "cancelled", job
        assert events(c, b, "stopped"), "stopped gracefully, before any step"
        assert_no_process_left(b)


def timestamp(s: str) -> float:
    return datetime.fromisoformat(s).timestamp()


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def plant_unacked(redis_server: RedisServer, job_id: str) -> str:
    """What kombu leaves in Redis for a message delivered but not acked (its worker died
    before acking): the payload under "unacked" and its delivery time in "unacked_index",
    here 100 s in the past."""
    from celery import Celery

    parking = f"parking-{secrets.token_hex(3)}"
    app = Celery("plant", broker=redis_server.url)
    try:
        app.send_task("ftune.run_job", args=[job_id], queue=parking)
    finally:
        app.close()
    r = redis_server.client()
    raw = r.lpop(parking)
    payload = json.loads(raw)
    tag = payload["properties"]["delivery_tag"]
    r.hset("unacked", tag, json.dumps([payload, "", QUEUE]))
    r.zadd("unacked_index", {tag: time.time() - 100})
    return job_id
