"""POST /v1/jobs/{id}/resume with num_processes / strategy: a paused job continues on
another slice when its latest checkpoint can be resharded there (its manifest says how it
was taken) and some registered worker can run it (the submit stage of admission), with a
"resized" event; otherwise a 422 naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import update

from core.db.models import Job
from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


def paused_job(api: Api, client: httpx.Client, fmt: str = "dcp", strategy: str = "ddp") -> str:
    """A paused 2-process job whose latest checkpoint (step 10) was taken with a global
    batch of 4 (2 per device x 2 processes)."""
    body = job_body(upload_rows(client, TEXT_ROWS),
                    distributed={"strategy": strategy, "num_processes": 2})
    job_id = str(client.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="paused", checkpoints=(10,))
    manifest = {"format": fmt, "step": 10, "strategy": strategy, "world_size": 2,
                "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                "trainable": "adapter"}
    (root / "checkpoints" / "checkpoint-10" / "ftune_checkpoint.json").write_text(
        json.dumps(manifest))
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(status="paused"))
        s.commit()
    return job_id


def test_a_paused_job_continues_on_one_process(api: Api, client_a: httpx.Client) -> None:
    job_id = paused_job(api, client_a)
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json={"num_processes": 1, "strategy": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
    d = r.json()["spec"]["distributed"]
    assert (d["strategy"], d["num_processes"]) == ("none", 1)
    events = client_a.get(f"/v1/jobs/{job_id}/events").json()["data"]
    (resized,) = [e for e in events if e["type"] == "resized"]
    assert resized["data"]["world_size"] == {"from": 2, "to": 1}
    assert resized["data"]["checkpoint"] == "checkpoint-10"
    assert api.enqueue.calls[-1] == (job_id, "queued")  # enqueued after the commit


def test_a_paused_deepspeed_job_continues_on_another_process_count(
    api: Api, client_a: httpx.Client
) -> None:
    """Its ZeRO checkpoint moves through DeepSpeed's universal checkpoint (the trainer
    converts it): accepted, as long as the global batch splits."""
    job_id = paused_job(api, client_a, "deepspeed", "deepspeed")
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json={"num_processes": 1})
    assert r.status_code == 200, r.text
    d = r.json()["spec"]["distributed"]
    assert (d["strategy"], d["num_processes"]) == ("deepspeed", 1)
    events = client_a.get(f"/v1/jobs/{job_id}/events").json()["data"]
    (resized,) = [e for e in events if e["type"] == "resized"]
    assert resized["data"]["world_size"] == {"from": 2, "to": 1}


@pytest.mark.parametrize(
    ("fmt", "strategy", "ask", "says"),
    [
        ("dcp", "ddp", {"num_processes": 3}, "does not split over 3 processes"),
        ("deepspeed", "deepspeed", {"num_processes": 3}, "does not split over 3 processes"),
        ("deepspeed", "deepspeed", {"strategy": "ddp"}, "does not load under ddp"),
    ],
    ids=["global-batch", "deepspeed-global-batch", "deepspeed-to-ddp"],
)
def test_a_slice_the_checkpoint_cannot_fill_is_refused(
    api: Api, client_a: httpx.Client, fmt: str, strategy: str, ask: dict[str, int], says: str
) -> None:
    job_id = paused_job(api, client_a, fmt, strategy)
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json=ask)
    assert r.status_code == 422, r.text
    (problem,) = r.json()["error"]["details"]
    assert problem["param"] == "num_processes" and says in problem["message"]
    assert client_a.get(f"/v1/jobs/{job_id}").json()["status"] == "paused"


def test_the_python_client_asks_for_another_slice(api: Api, client_a: httpx.Client) -> None:
    from client import FtuneClient

    job_id = paused_job(api, client_a)
    with FtuneClient(api.url, api.key_a) as c:
        job = c.resume_job(job_id, num_processes=4)
    assert (job["status"], job["spec"]["distributed"]["num_processes"]) == ("queued", 4)


def test_resume_without_a_body_keeps_the_slice(api: Api, client_a: httpx.Client) -> None:
    job_id = paused_job(api, client_a)
    r = client_a.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 200 and r.json()["spec"]["distributed"]["num_processes"] == 2


def test_more_processes_than_any_worker_has_is_refused_at_resume(
        api: Api, client_a: httpx.Client, fleet: Callable[..., None]) -> None:
    fleet("node-2gpu", gpus=2)
    job_id = paused_job(api, client_a)
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json={"num_processes": 4})
    assert r.status_code == 422, r.text
    (problem,) = r.json()["error"]["details"]
    assert problem["param"] == "num_processes"
    assert "4 processes but the largest worker has 2 GPUs" in problem["message"]
    job = client_a.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "paused"  # not queued forever
    assert job["spec"]["distributed"]["num_processes"] == 2  # and not changed


def test_a_strategy_no_worker_can_run_is_refused_at_resume(
        api: Api, client_a: httpx.Client, fleet: Callable[..., None]) -> None:
    fleet("cpu-node", gpus=0)  # FSDP on CPU needs the operator's FTUNE_CPU_FSDP2
    job_id = paused_job(api, client_a)
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json={"strategy": "fsdp"})
    assert r.status_code == 422, r.text
    (problem,) = r.json()["error"]["details"]
    assert problem["param"] == "strategy" and "fsdp needs a GPU worker" in problem["message"]
    assert client_a.get(f"/v1/jobs/{job_id}").json()["status"] == "paused"


def test_a_slice_the_fleet_has_is_admitted(api: Api, client_a: httpx.Client,
                                           fleet: Callable[..., None]) -> None:
    fleet("node-2gpu", gpus=2)
    job_id = paused_job(api, client_a)
    r = client_a.post(f"/v1/jobs/{job_id}/resume", json={"num_processes": 1, "strategy": "none"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "queued"
