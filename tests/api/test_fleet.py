"""The fleet through the API: admin-only /v1/workers and drain, admission against the
registered workers (422 naming the field), the tenant's priority bound, and a queued job's
position and reason to wait."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from api.services.queue import queue_infos
from core.db.models import GpuAllocation, Job, JobStatus, Worker, utcnow
from core.infra.settings import Settings
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    # These tests move jobs in the database and read their queue info at once: no snapshot.
    return api_settings.model_copy(update={"queue_snapshot_seconds": 0})


@pytest.fixture
def text_file(client_a: httpx.Client) -> str:
    return upload_rows(client_a, TEXT_ROWS)


def submit(client: httpx.Client, file_id: str, **overrides: Any) -> httpx.Response:
    return client.post("/v1/jobs", json=job_body(file_id, **overrides))


def test_workers_are_for_admin_keys_only(api: Api, fleet: Any, client_a: httpx.Client,
                                         client_b: httpx.Client) -> None:
    fleet("node-1", gpus=2)

    assert client_b.get("/v1/workers").status_code == 403
    assert client_b.post("/v1/workers/node-1/drain").json()["error"]["code"] == "forbidden"
    body = client_a.get("/v1/workers").json()  # the bootstrap key is the operator's: admin
    [worker] = body["data"]
    assert (worker["id"], worker["state"], worker["slots"]) == ("node-1", "active", 2)
    assert [(g["index"], g["name"], g["job_id"]) for g in worker["gpus"]] == [
        (0, "H100", None), (1, "H100", None)]


def test_drain_and_undrain(fleet: Any, client_a: httpx.Client) -> None:
    fleet("node-1", gpus=1)

    assert client_a.post("/v1/workers/node-1/drain").json()["state"] == "draining"
    assert client_a.post("/v1/workers/node-1/drain").json()["state"] == "draining"
    assert client_a.post("/v1/workers/node-1/undrain").json()["state"] == "active"
    assert client_a.post("/v1/workers/nope/drain").status_code == 404


@pytest.mark.parametrize(("overrides", "param", "says"), [
    ({"distributed": {"strategy": "ddp", "num_processes": 64}}, "distributed.num_processes",
     "64 processes but the largest worker has 8 GPUs"),
    ({"distributed": {"strategy": "ddp", "num_processes": 4, "num_machines": 2,
                      "main_process_ip": "10.0.0.1"}},
     "distributed.num_machines", "no registered multi-node pool"),
])
def test_what_no_gpu_worker_can_run_is_a_422(fleet: Any, client_a: httpx.Client,
                                             text_file: str, overrides: dict[str, Any],
                                             param: str, says: str) -> None:
    fleet("node-1", gpus=8)
    fleet("node-2", gpus=4)

    r = submit(client_a, text_file, **overrides)

    assert r.status_code == 422, r.text
    [problem] = [d for d in r.json()["error"]["details"] if d["param"] == param]
    assert says in problem["message"]


def test_bf16_on_a_cpu_only_fleet_is_a_422(fleet: Any, client_a: httpx.Client,
                                            text_file: str) -> None:
    fleet("cpu-1")

    r = submit(client_a, text_file, training={"max_steps": 1, "mixed_precision": "bf16"})

    assert r.status_code == 422
    [problem] = r.json()["error"]["details"]
    assert problem["param"] == "training.mixed_precision"
    assert "needs a GPU worker" in problem["message"] and "CPU-only" in problem["message"]


def test_with_no_worker_registered_the_job_is_admitted(fleet: Any, client_a: httpx.Client,
                                                      text_file: str) -> None:
    r = submit(client_a, text_file, distributed={"strategy": "ddp", "num_processes": 64})

    assert r.status_code == 201
    assert r.json()["queue"]["waiting_for"] == "worker"


def test_priority_above_the_tenant_bound_is_a_422(fleet: Any, client_a: httpx.Client,
                                                  text_file: str) -> None:
    r = submit(client_a, text_file, priority=11)  # default bound: FTUNE_MAX_PRIORITY 10

    assert r.status_code == 422
    assert r.json()["error"]["param"] == "priority"
    assert submit(client_a, text_file, priority=10).json()["priority"] == 10


def test_a_queued_job_says_its_position_and_what_it_waits_for(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str) -> None:
    fleet("node-1", gpus=2)
    first = submit(client_a, text_file, priority=3).json()
    big = submit(client_a, text_file, distributed={"strategy": "ddp", "num_processes": 2})
    with api.maker.begin() as s:  # a running job holds GPU 0
        s.execute(update(Job).where(Job.id == first["id"]).values(status=JobStatus.running))
        s.add(GpuAllocation(worker_id="node-1", gpu_index=0, job_id=first["id"], attempt=1))

    job = client_a.get(f"/v1/jobs/{big.json()['id']}").json()

    assert job["queue"]["position"] == 0
    assert job["queue"]["waiting_for"] == "gpus"
    assert "needs 2, the most free on a worker that can run it is 1" in job["queue"]["message"]
    assert client_a.get(f"/v1/jobs/{first['id']}").json()["queue"] is None
    workers = client_a.get("/v1/workers").json()["data"]
    assert workers[0]["running_jobs"] == [first["id"]]


def test_the_operator_may_queue_what_the_fleet_cannot_run_yet(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fleet("node-1", gpus=2)
    monkeypatch.setattr(api.settings, "queue_unrunnable", True)

    r = submit(client_a, text_file, distributed={"strategy": "ddp", "num_processes": 4})

    assert r.status_code == 201
    queue = r.json()["queue"]
    assert queue["waiting_for"] == "worker"
    assert "4 processes but the largest worker has 2 GPUs" in queue["message"]


def test_metrics_show_gpu_allocation_per_worker_and_wait_by_priority(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str) -> None:
    fleet("node-1", gpus=2)
    running = submit(client_a, text_file).json()
    submit(client_a, text_file, priority=5)
    with api.maker.begin() as s:
        s.execute(update(Job).where(Job.id == running["id"]).values(status=JobStatus.running))
        s.add(GpuAllocation(worker_id="node-1", gpu_index=1, job_id=running["id"], attempt=1))

    text = httpx.get(f"{api.url}/metrics").text

    assert 'ftune_worker_gpus{state="active",worker="node-1"} 2.0' in text
    assert 'ftune_worker_gpus_allocated{worker="node-1"} 1.0' in text
    assert 'ftune_queued_jobs{priority="5"} 1.0' in text
    assert 'ftune_queue_wait_seconds{priority="5"}' in text


def test_metrics_leave_out_workers_not_seen_for_a_day(api: Api, fleet: Any) -> None:
    fleet("node-1", gpus=2)
    fleet("node-old", gpus=4)
    with api.maker.begin() as s:
        s.execute(update(Worker).where(Worker.id == "node-old")
                  .values(state="lost", heartbeat_at=utcnow() - timedelta(days=2)))

    text = httpx.get(f"{api.url}/metrics").text

    assert 'ftune_worker_gpus{state="active",worker="node-1"} 2.0' in text
    assert "node-old" not in text


def test_a_multi_node_pool_admits_what_single_nodes_cannot(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str) -> None:
    from core.db.models import utcnow

    fleet("node-1", gpus=8)
    with api.maker.begin() as s:  # as the SLURM executor registers its pool
        now = utcnow()
        s.add(Worker(id="slurm-pool", host="slurmctld", executor="slurm",
                     gpus=[{"index": i, "name": "H100", "memory_mb": 81559} for i in range(8)],
                     cpu_cores=64, capabilities={"cuda": True, "bf16": True, "max_machines": 4},
                     slots=16, state="active", started_at=now, heartbeat_at=now))

    r = submit(client_a, text_file, distributed={
        "strategy": "ddp", "num_processes": 16, "num_machines": 2, "main_process_ip": "10.0.0.1"})

    assert r.status_code == 201, r.text
    assert r.json()["queue"]["waiting_for"] == "worker"  # the local scheduler does not place it


def test_create_key_admin_makes_an_admin_key(api: Api) -> None:
    from api.services.keys import create_api_key, list_api_keys

    with api.maker.begin() as s:
        key = create_api_key(s, "ops", "oncall", role="admin")
    with api.maker() as s:
        [info] = [k for k in list_api_keys(s, "ops") if k.prefix == key[:10]]
    assert info.role == "admin"
    r = httpx.get(f"{api.url}/v1/workers", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200


def _positions(api: Api, job_ids: list[str], window: float) -> dict[str, int]:
    settings = api.settings.model_copy(update={"queue_snapshot_seconds": window})
    with api.maker() as s:
        jobs = [s.get_one(Job, j) for j in job_ids]
        infos = queue_infos(s, jobs, settings, utcnow())
    return {j: infos[j].position for j in infos}


def test_queue_info_is_read_from_a_snapshot_while_it_is_fresh(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str) -> None:
    fleet("node-1", gpus=1)
    first = submit(client_a, text_file, priority=3).json()["id"]
    second = submit(client_a, text_file).json()["id"]
    assert _positions(api, [second], window=60) == {second: 1}
    with api.maker.begin() as s:  # a worker claims the first: the second moves up
        s.execute(update(Job).where(Job.id == first).values(status=JobStatus.running))

    assert _positions(api, [second], window=60) == {second: 1}  # the snapshot's view
    assert _positions(api, [second], window=0) == {second: 0}  # a fresh one


def test_a_job_queued_after_the_snapshot_is_never_read_from_it(
        api: Api, fleet: Any, client_a: httpx.Client, text_file: str) -> None:
    fleet("node-1", gpus=1)
    first = submit(client_a, text_file).json()["id"]
    assert _positions(api, [first], window=60) == {first: 0}

    later = submit(client_a, text_file).json()["id"]

    assert _positions(api, [later], window=60) == {later: 1}
