"""model.from_job: a job continues another job's adapter (a checkpoint's, or the final one),
checked at submit: tenant-confined, the step must be stored, the adapter must be the same."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


@pytest.fixture
def file_id(client_a: httpx.Client) -> str:
    return upload_rows(client_a, TEXT_ROWS)


@pytest.fixture
def source(api: Api, client_a: httpx.Client, file_id: str) -> str:
    """Tenant A's job with checkpoints at steps 5 and 10, still running."""
    body = job_body(file_id, peft={"method": "lora", "r": 4, "lora_alpha": 8})
    job_id = str(client_a.post("/v1/jobs", json=body).json()["id"])
    fake_run(api, job_id, status="running", checkpoints=(5, 10))
    return job_id


def continuing(file_id: str, model: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return {**job_body(file_id, **overrides), "model": model}


def problems(r: httpx.Response) -> dict[str, str]:
    assert r.status_code == 422, r.text
    return {p["param"]: p["message"] for p in r.json()["error"]["details"]}


def test_a_checkpoint_continues_with_the_source_base_and_adapter(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    r = client_a.post("/v1/jobs", json=continuing(file_id, {"from_job": source, "step": 5}))
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    # What the request left out is the source's: its base, task and peft settings.
    assert spec["model"]["name_or_path"] == "org/tiny-model"
    assert (spec["model"]["from_job"], spec["model"]["step"]) == (source, 5)
    assert (spec["peft"]["r"], spec["peft"]["lora_alpha"]) == (4, 8)


def test_a_missing_step_names_the_field_and_the_stored_steps(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    r = client_a.post("/v1/jobs", json=continuing(file_id, {"from_job": source, "step": 7}))
    message = problems(r)["model.step"]
    assert "no checkpoint at step 7" in message and "[5, 10]" in message


def test_the_final_adapter_of_an_unfinished_job_is_refused(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    r = client_a.post("/v1/jobs", json=continuing(file_id, {"from_job": source}))
    message = problems(r)["model.from_job"]
    assert "no final adapter" in message and "model.step" in message


def test_another_tenants_job_reads_as_not_found(
    client_b: httpx.Client, source: str
) -> None:
    file_b = upload_rows(client_b, TEXT_ROWS)
    r = client_b.post("/v1/jobs", json=continuing(file_b, {"from_job": source, "step": 5}))
    assert problems(r)["model.from_job"] == f"job {source} not found"


def test_another_adapter_shape_is_refused(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    body = continuing(
        file_id,
        {"from_job": source, "step": 10},
        peft={"method": "lora", "r": 16, "lora_alpha": 8},
    )
    assert "r differ" in problems(client_a.post("/v1/jobs", json=body))["peft"]


def test_another_base_model_is_refused(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    model = {"from_job": source, "step": 10, "name_or_path": "org/other-model"}
    r = client_a.post("/v1/jobs", json=continuing(file_id, model))
    assert "org/tiny-model" in problems(r)["model.name_or_path"]


def test_a_step_without_from_job_is_refused(client_a: httpx.Client, file_id: str) -> None:
    model = {"name_or_path": "org/tiny-model", "step": 10}
    r = client_a.post("/v1/jobs", json=continuing(file_id, model))
    assert "model.step" in problems(r)


@pytest.fixture
def full_source(api: Api, client_a: httpx.Client, file_id: str) -> str:
    """Tenant A's full fine-tune (peft method full), running, with its model in the
    checkpoint at step 4 (checkpoint-4/model, as the trainer writes it)."""
    body = job_body(file_id, peft={"method": "full"})
    job_id = str(client_a.post("/v1/jobs", json=body).json()["id"])
    root = fake_run(api, job_id, status="running", checkpoints=(4,))
    model = root / "checkpoints" / "checkpoint-4" / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return job_id


def test_a_full_job_continues_a_full_jobs_checkpoint_on_another_strategy(
    client_a: httpx.Client, full_source: str, file_id: str
) -> None:
    body = continuing(file_id, {"from_job": full_source, "step": 4},
                      distributed={"strategy": "ddp", "num_processes": 2})
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["peft"] == {"method": "full"}  # the source's, left out of the request
    assert spec["model"]["name_or_path"] == "org/tiny-model"


def test_a_full_job_missing_step_names_the_field(
    client_a: httpx.Client, full_source: str, file_id: str
) -> None:
    r = client_a.post("/v1/jobs", json=continuing(file_id, {"from_job": full_source, "step": 5}))
    assert "no checkpoint at step 5: its stored checkpoints are at steps [4]" in problems(r)[
        "model.step"]
    r = client_a.post("/v1/jobs", json=continuing(file_id, {"from_job": full_source}))
    assert "no final model; give model.step, one of [4]" in problems(r)["model.from_job"]


def test_an_adapter_on_a_full_jobs_weights_is_refused_naming_the_method(
    client_a: httpx.Client, full_source: str, file_id: str
) -> None:
    body = continuing(file_id, {"from_job": full_source, "step": 4},
                      peft={"method": "lora", "r": 4})
    assert "trained the whole model" in problems(client_a.post("/v1/jobs", json=body))[
        "peft.method"]


def test_a_full_fine_tune_from_an_adapter_job_is_refused_naming_the_method(
    client_a: httpx.Client, source: str, file_id: str
) -> None:
    body = continuing(file_id, {"from_job": source, "step": 5}, peft={"method": "full"})
    message = problems(client_a.post("/v1/jobs", json=body))["peft.method"]
    assert "does not start from an adapter" in message


def test_another_tenants_full_job_reads_as_not_found(
    client_b: httpx.Client, full_source: str
) -> None:
    file_b = upload_rows(client_b, TEXT_ROWS)
    r = client_b.post("/v1/jobs", json=continuing(file_b, {"from_job": full_source, "step": 4}))
    assert problems(r)["model.from_job"] == f"job {full_source} not found"
