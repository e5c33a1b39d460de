"""Admission chooses the strategy and process count of a spec that does not name them, from
the model's memory estimate and the registered GPUs, and says so."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, update

from api.services.placement import memory_need
from core.db.models import Job, JobEvent, JobStatus, Worker
from core.policy.placement import HEADROOM
from core.spec import parse_job_spec
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows
from worker.upkeep.registry import Inventory, register


@pytest.fixture(scope="module")
def model(api: Api, tiny_causal_lm: Path) -> str:
    dest = api.settings.allowed_model_roots[0] / "tiny-llama"
    if not dest.exists():
        shutil.copytree(tiny_causal_lm, dest)
    return str(dest)


@pytest.fixture
def small_gpus(api: Api, model: str, client_a: httpx.Client) -> Iterator[dict[str, Any]]:
    """A worker of 4 GPUs, each too small for the job unsharded, big enough sharded by 2."""
    body = job_body(upload_rows(client_a, TEXT_ROWS), model={"name_or_path": model})
    need = memory_need(parse_job_spec(body), api.settings)
    assert need is not None
    memory = need.per_gpu(2) / HEADROOM * 1.001
    assert need.per_gpu(1) > memory * HEADROOM
    inv = Inventory("node", [{"index": i, "name": "small", "memory_mb": memory}
                             for i in range(4)], 16,
                    {"cuda": True, "bf16": True, "max_machines": 1}, 4)
    with api.maker.begin() as s:
        register(s, "gpu-node", inv)
    yield body
    with api.maker.begin() as s:
        s.execute(update(Job).where(Job.status == JobStatus.queued)
                  .values(status=JobStatus.cancelled))
        s.execute(delete(Worker))


def test_a_spec_without_distributed_is_sharded_where_it_does_not_fit_one_gpu(
        api: Api, client_a: httpx.Client, small_gpus: dict[str, Any]) -> None:
    r = client_a.post("/v1/jobs", json=small_gpus)
    assert r.status_code == 201, r.text
    job = r.json()
    assert (job["spec"]["distributed"]["strategy"], job["spec"]["distributed"]["num_processes"]) \
        == ("fsdp", 2)
    assert "distributed" not in job["request"]
    with api.maker() as s:
        queued = s.query(JobEvent).filter(JobEvent.job_id == job["id"]).first()
    assert queued is not None and queued.data["placement"]["num_processes"] == 2
    assert "FSDP over 2 GPUs" in queued.data["placement"]["reason"]


def test_a_spec_that_names_distributed_keeps_it(client_a: httpx.Client,
                                                small_gpus: dict[str, Any]) -> None:
    body = {**small_gpus, "distributed": {"strategy": "ddp", "num_processes": 2}}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["distributed"]["strategy"] == "ddp"
