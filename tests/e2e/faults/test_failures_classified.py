"""The real trainer with a fault injected ends failed with the code that names it and the
tail of its log: out of memory, a NaN loss, a full disk, a rank of a DDP run dying."""

from __future__ import annotations

from pathlib import Path

import pytest

from client import FtuneClient
from testkit.faultstack import (
    FaultStack,
)
from tests.utils.faults import (
    assert_no_process_left,
    events,
    real_spec,
    timestamp,
    wait_all,
)

pytestmark = pytest.mark.e2e


def test_trainer_failures_end_with_their_code_and_the_log_tail(
        stack: FaultStack, client: FtuneClient, tiny_causal_lm: Path, lm_file: str) -> None:
    """The real trainer with a fault injected: out of memory, a NaN loss, a full disk at the
    first checkpoint, and rank 1 of a 2-process DDP run dying at step 2 (rank 0 must not
    hang in its next collective)."""
    ds = {"file_id": lm_file}
    ids = {
        "out_of_memory": client.create_job(real_spec(tiny_causal_lm, ds, "oom"))["id"],
        "nan_loss": client.create_job(real_spec(tiny_causal_lm, ds, "nan"))["id"],
        "disk_full": client.create_job(real_spec(tiny_causal_lm, ds, "disk_full"))["id"],
    }
    ddp = real_spec(tiny_causal_lm, ds, "rank_crash", max_steps=20, save_steps=100)
    ddp["distributed"] = {"strategy": "ddp", "num_processes": 2}
    ids["trainer_crashed"] = client.create_job(ddp)["id"]

    jobs = wait_all(client, list(ids.values()), 300)
    for code, job_id in ids.items():
        job = jobs[job_id]
        assert job["status"] == "failed", (code, job)
        assert job["error"]["code"] == code, job["error"]
        tail = [e for e in events(client, job_id, "log") if "trainer.log" in e["message"]]
        assert tail and tail[0]["data"]["lines"], f"{code}: no log tail"
        assert not job["adapter_available"]
        assert_no_process_left(job_id)
    assert "out of memory" in jobs[ids["out_of_memory"]]["error"]["message"]
    assert "non-finite" in jobs[ids["nan_loss"]]["error"]["message"]
    assert "disk is full" in jobs[ids["disk_full"]]["error"]["message"]
    crash = jobs[ids["trainer_crashed"]]
    assert "rank 1 failed first (exit code 1" in crash["error"]["message"]
    tail = next(e for e in events(client, ids["trainer_crashed"], "log")
                if "trainer.log" in e["message"])
    assert any("rank 1 dies now" in line or "Root Cause" in line for line in tail["data"]["lines"])
    started = events(client, ids["trainer_crashed"], "started")
    assert started and started[0]["data"]["world_size"] == 2
    # Torn down as soon as rank 1 died, not after some collective timeout.
    last_progress = timestamp(events(client, ids["trainer_crashed"], "progress")[-1]["created_at"])
    assert timestamp(crash["finished_at"]) - last_progress < 30
