"""What a run produced: events, checkpoints, logs, launch command, adapter zips."""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile

import httpx
import pytest
from sqlalchemy import update

from core.db.models import Job, JobEvent
from tests.api.jobfixtures import ADAPTER_FILES, fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


@pytest.fixture
def job_id(api: Api, client_a: httpx.Client) -> str:
    file_id = upload_rows(client_a, TEXT_ROWS)
    return str(client_a.post("/v1/jobs", json=job_body(file_id)).json()["id"])


def test_logs_tail_reads_the_last_lines(api: Api, client_a: httpx.Client, job_id: str) -> None:
    fake_run(api, job_id, log_lines=30_000)
    r = client_a.get(f"/v1/jobs/{job_id}/logs", params={"tail": 3})
    assert r.json() == {"lines": ["line 29998", "line 29999", "line 30000"]}
    default = client_a.get(f"/v1/jobs/{job_id}/logs").json()["lines"]
    assert len(default) == 200 and default[-1] == "line 30000" and default[0] == "line 29801"
    many = client_a.get(f"/v1/jobs/{job_id}/logs", params={"tail": 10_000}).json()["lines"]
    assert len(many) == 10_000 and many[0] == "line 20001"


def test_logs_before_launch_are_empty(client_a: httpx.Client, job_id: str) -> None:
    assert client_a.get(f"/v1/jobs/{job_id}/logs").json() == {"lines": []}
    assert client_a.get(f"/v1/jobs/{job_id}/logs", params={"tail": 0}).status_code == 422


def test_adapter_is_409_before_success(api: Api, client_a: httpx.Client, job_id: str) -> None:
    r = client_a.get(f"/v1/jobs/{job_id}/adapter")
    assert r.status_code == 409
    assert r.json()["error"]["message"] == "adapter not available: job is queued"
    fake_run(api, job_id, status="running")
    assert "job is running" in client_a.get(f"/v1/jobs/{job_id}/adapter").json()["error"]["message"]


def test_adapter_zip_after_success(api: Api, client_a: httpx.Client, job_id: str) -> None:
    fake_run(api, job_id, status="succeeded", adapter=True)
    job = client_a.get(f"/v1/jobs/{job_id}").json()
    assert job["adapter_available"] is True
    r = client_a.get(f"/v1/jobs/{job_id}/adapter")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
    assert f"{job_id}-adapter.zip" in r.headers["content-disposition"]
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.testzip() is None
        assert {n: zf.read(n) for n in zf.namelist()} == ADAPTER_FILES


def test_checkpoint_zip_holds_adapter_files_only(
    api: Api, client_a: httpx.Client, job_id: str
) -> None:
    fake_run(api, job_id, status="running", checkpoints=(5, 10))
    r = client_a.get(f"/v1/jobs/{job_id}/adapter", params={"checkpoint": 5})
    assert r.status_code == 200
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert sorted(zf.namelist()) == sorted(ADAPTER_FILES)
    missing = client_a.get(f"/v1/jobs/{job_id}/adapter", params={"checkpoint": 7})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "checkpoint"


def test_adapter_never_serves_outside_the_job_dir(
    api: Api, client_a: httpx.Client, job_id: str
) -> None:
    root = fake_run(api, job_id, status="succeeded", adapter=True)
    secret = api.roots / "secret.txt"
    secret.write_text("top secret")
    (root / "adapter" / "leak.json").symlink_to(secret)
    with zipfile.ZipFile(io.BytesIO(client_a.get(f"/v1/jobs/{job_id}/adapter").content)) as zf:
        assert "leak.json" not in zf.namelist()
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(adapter_path=str(api.roots)))
        s.commit()
    assert client_a.get(f"/v1/jobs/{job_id}/adapter").status_code == 409


def test_checkpoints_listed_by_step(api: Api, client_a: httpx.Client, job_id: str) -> None:
    fake_run(api, job_id, checkpoints=(10, 5))
    data = client_a.get(f"/v1/jobs/{job_id}/checkpoints").json()["data"]
    assert [(c["step"], c["path"]) for c in data] == [
        (5, "checkpoints/checkpoint-5"),
        (10, "checkpoints/checkpoint-10"),
    ]
    assert data[0]["metrics"] == {"loss": 0.2}
    assert client_a.get(f"/v1/jobs/{job_id}").json()["checkpoints_count"] == 2


def test_launch_404_until_launched(api: Api, client_a: httpx.Client, job_id: str) -> None:
    assert client_a.get(f"/v1/jobs/{job_id}/launch").status_code == 404
    launch = {
        "argv": ["accelerate", "launch", "--config_file", "x.yaml", "-m", "core.train"],
        "accelerate_yaml": "distributed_type: NO\n",
        "env": {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "2"},
        "cpus": [2, 3],  # a CPU slot's cores (FTUNE_WORKER_PIN_CPUS)
    }
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(launch=launch))
        s.commit()
    local = {**launch, "sbatch_script": None, "slurm_job_id": None}
    assert client_a.get(f"/v1/jobs/{job_id}/launch").json() == local
    slurm = {**launch, "argv": ["sbatch", "--parsable", "/shared/job/sbatch.sh"],
             "sbatch_script": "#!/bin/bash\nsrun ...\n", "slurm_job_id": "42",
             "executor": "slurm"}
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(launch=slurm))
        s.commit()
    got = client_a.get(f"/v1/jobs/{job_id}/launch").json()
    assert (got["argv"], got["sbatch_script"], got["slurm_job_id"]) == (
        slurm["argv"], slurm["sbatch_script"], "42")


def test_events_paginate_with_after(api: Api, client_a: httpx.Client, job_id: str) -> None:
    with api.session() as s:
        s.add_all(JobEvent(job_id=job_id, type="progress", data={"step": i}) for i in range(1, 6))
        s.commit()
    first = client_a.get(f"/v1/jobs/{job_id}/events", params={"limit": 3}).json()
    assert [e["type"] for e in first["data"]] == ["status", "progress", "progress"]
    assert first["has_more"] is True
    rest = client_a.get(
        f"/v1/jobs/{job_id}/events", params={"after": first["data"][-1]["id"]}
    ).json()
    assert [e["data"]["step"] for e in rest["data"]] == [3, 4, 5] and rest["has_more"] is False


def test_events_stream_until_the_job_finishes(
    api: Api, client_a: httpx.Client, job_id: str
) -> None:
    def finish_later() -> None:
        time.sleep(0.7)
        with api.session() as s:
            s.add(JobEvent(job_id=job_id, type="finished", data={"step": 10}))
            s.execute(update(Job).where(Job.id == job_id).values(status="succeeded"))
            s.commit()

    threading.Thread(target=finish_later).start()
    events: list[tuple[str, dict]] = []
    with client_a.stream(
        "GET", f"/v1/jobs/{job_id}/events", headers={"Accept": "text/event-stream"}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind or "", json.loads(line[6:])))
    assert [k for k, _ in events] == ["status", "finished", "end"]
    assert events[-1][1] == {"status": "succeeded"}
    # Resume from the last id seen: only the end marker is left.
    last_id = str(events[1][1]["id"])
    with client_a.stream(
        "GET",
        f"/v1/jobs/{job_id}/events",
        headers={"Accept": "text/event-stream", "Last-Event-ID": last_id},
    ) as r:
        body = r.read().decode()
    assert "event: finished" not in body and "event: end" in body
