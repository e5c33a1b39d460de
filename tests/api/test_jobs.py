"""POST/GET /v1/jobs and cancel, on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from core.db.models import Job, JobEvent, utcnow
from tests.utils.api import TEXT_ROWS, Api, job_body, migrated_sqlite_url, upload_rows
from tests.utils.savedisk import save_to_disk


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_url"))
    return migrated_sqlite_url(tmp_path_factory)


@pytest.fixture(scope="module")
def text_file(api: Api) -> str:
    return upload_rows(api.client(api.key_a), TEXT_ROWS)


CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
    for i in range(4)
]


def _set(api: Api, job_id: str, **values: Any) -> None:
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job_id).values(**values))
        s.commit()


def _params(r: httpx.Response) -> list[str]:
    return [d["param"] for d in r.json()["error"]["details"]]


def test_create_job_queues_and_enqueues_after_commit(
    api: Api, client_a: httpx.Client, text_file: str
) -> None:
    r = client_a.post("/v1/jobs", json=job_body(text_file, name="first"))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["status"] == "queued" and job["name"] == "first"
    assert job["spec"]["dataset"]["file_id"] == text_file
    assert job["progress"] == {
        "step": 0,
        "total_steps": None,
        "epoch": None,
        "percent": None,
        "eta_seconds": None,
    }
    assert job["adapter_available"] is False and job["error"] is None
    assert job["checkpoints_count"] == 0 and job["attempt"] == 0
    # The fake read the row on its own connection: it was committed before the enqueue.
    assert (job["id"], "queued") in api.enqueue.calls
    with api.session() as s:
        events = s.scalars(select(JobEvent).where(JobEvent.job_id == job["id"])).all()
    assert [(e.type, e.message) for e in events] == [("status", "queued")]
    assert events[0].data["train_rows"] == len(TEXT_ROWS)


def test_enqueue_failure_leaves_job_queued(
    api: Api, client_a: httpx.Client, text_file: str
) -> None:
    api.enqueue.fail = True
    try:
        r = client_a.post("/v1/jobs", json=job_body(text_file))
    finally:
        api.enqueue.fail = False
    assert r.status_code == 201
    assert client_a.get(f"/v1/jobs/{r.json()['id']}").json()["status"] == "queued"


def test_spec_with_several_problems_is_one_422(client_a: httpx.Client, text_file: str) -> None:
    body = job_body(
        text_file,
        peft={"method": "lora", "r": 0, "lora_dropout": 2},
        training={"learning_rate": -1, "eval_steps": 10},
        distributed={
            "strategy": "deepspeed",
            "num_processes": 2,
            "deepspeed": {"zero_stage": 1, "offload_param_device": "cpu"},
        },
        bogus=1,
    )
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "invalid_spec"
    assert {"peft.r", "peft.lora_dropout", "training.learning_rate", "bogus"} <= set(_params(r))


def test_quantization_that_cannot_be_sharded_is_a_422_naming_why(
    client_a: httpx.Client, text_file: str
) -> None:
    body = job_body(text_file, distributed={"strategy": "fsdp", "num_processes": 2})
    body["model"]["quantization"] = {"load_in": "4bit"}
    body["peft"] = {"method": "ia3"}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    details = {d["param"]: d["message"] for d in r.json()["error"]["details"]}
    assert set(details) >= {
        "model.quantization.quant_storage",
        "distributed.fsdp.cpu_ram_efficient_loading",
        "peft.method",
    }
    assert "FSDP2 leaves uint8 4-bit weights whole" in details["model.quantization.quant_storage"]

    body = job_body(text_file, distributed={"strategy": "ddp", "num_processes": 2})
    body["model"]["quantization"] = {"load_in": "8bit"}
    assert client_a.post("/v1/jobs", json=body).status_code == 201


def test_cross_field_and_context_problems_come_together(client_a: httpx.Client) -> None:
    body = {
        "model": {"name_or_path": "/etc", "trust_remote_code": True},
        "dataset": {"file_id": "file-nope", "path": "/etc/passwd"},
        "training": {"eval_steps": 5},
    }
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    params = _params(r)
    assert "training.eval_steps" in params  # cross-field
    assert "model.name_or_path" in params and "model.trust_remote_code" in params  # server
    assert "dataset.path" in params and params.count("dataset.file_id") == 2


def test_field_error_and_model_path_problem_in_one_422(
    client_a: httpx.Client, text_file: str
) -> None:
    body = job_body(text_file, model={"name_or_path": "/opt/elsewhere"}, peft={"r": 0})
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert {"peft.r", "model.name_or_path"} <= set(_params(r))


def test_dataset_missing_field_names_param_and_row(client_a: httpx.Client) -> None:
    rows = [{"text": "fine"}, {"text": "fine"}, {"body": "no text here"}, {"text": ""}]
    file_id = upload_rows(client_a, rows)
    r = client_a.post("/v1/jobs", json=job_body(file_id))
    assert r.status_code == 422
    details = r.json()["error"]["details"]
    assert {"param": "dataset.text_field", "message": "row 3: missing field 'text'"} in details
    assert {"param": "dataset.text_field", "message": "row 4: field 'text': empty text"} in details


def test_dataset_problems_are_capped_with_a_count(client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, [{"text": i} for i in range(50)])
    r = client_a.post("/v1/jobs", json=job_body(file_id))
    details = r.json()["error"]["details"]
    assert len(details) == 21
    assert "30 more problems not listed (50 in all)" in details[-1]["message"]


def test_model_path_outside_roots_is_422(api: Api, client_a: httpx.Client, text_file: str) -> None:
    outside = api.roots / "not-a-root"
    outside.mkdir(exist_ok=True)
    (outside / "config.json").write_text("{}")
    r = client_a.post("/v1/jobs", json=job_body(text_file, model={"name_or_path": str(outside)}))
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "model.name_or_path"
    assert "outside the allowed roots" in r.json()["error"]["message"]


def test_model_path_traversal_is_422(api: Api, client_a: httpx.Client, text_file: str) -> None:
    sneaky = f"{api.settings.allowed_model_roots[0]}/../not-a-root"
    r = client_a.post("/v1/jobs", json=job_body(text_file, model={"name_or_path": sneaky}))
    assert r.status_code == 422


def test_model_dir_needs_config_json(api: Api, client_a: httpx.Client, text_file: str) -> None:
    root = api.settings.allowed_model_roots[0]
    bad = client_a.post(
        "/v1/jobs", json=job_body(text_file, model={"name_or_path": str(root / "no-config")})
    )
    assert bad.status_code == 422 and "config.json" in bad.json()["error"]["message"]
    ok = client_a.post(
        "/v1/jobs", json=job_body(text_file, model={"name_or_path": str(root / "tiny")})
    )
    assert ok.status_code == 201, ok.text


def test_dataset_path_under_data_root(api: Api, client_a: httpx.Client) -> None:
    data = api.settings.allowed_data_roots[0] / "train.jsonl"
    data.write_text('{"text": "hello"}\n{"text": "world"}\n')
    body = {"model": {"name_or_path": "org/m"}, "dataset": {"path": str(data)}}
    assert client_a.post("/v1/jobs", json=body).status_code == 201


def test_idempotency_key_returns_same_job(client_a: httpx.Client, text_file: str) -> None:
    headers = {"Idempotency-Key": "retry-me-1"}
    first = client_a.post("/v1/jobs", json=job_body(text_file), headers=headers)
    again = client_a.post("/v1/jobs", json=job_body(text_file), headers=headers)
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"


def test_idempotency_key_with_other_body_is_409(client_a: httpx.Client, text_file: str) -> None:
    headers = {"Idempotency-Key": "retry-me-2"}
    assert client_a.post("/v1/jobs", json=job_body(text_file), headers=headers).status_code == 201
    r = client_a.post("/v1/jobs", json=job_body(text_file, name="changed"), headers=headers)
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "idempotency_conflict"


def test_cancel_queued_job_is_cancelled(client_a: httpx.Client, text_file: str) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(text_file)).json()["id"]
    r = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200
    assert r.json()["status"] == "cancelled" and r.json()["finished_at"] is not None
    again = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 200 and again.json() == r.json()


def test_cancel_running_job_is_cancelling(api: Api, client_a: httpx.Client, text_file: str) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(text_file)).json()["id"]
    _set(api, job_id, status="running", started_at=utcnow(), attempt=1)
    r = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelling"
    with api.session() as s:
        job = s.get_one(Job, job_id)
    assert job.cancel_requested_at is not None and job.finished_at is None


def test_cancel_finished_job_is_unchanged(api: Api, client_a: httpx.Client, text_file: str) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(text_file)).json()["id"]
    _set(api, job_id, status="succeeded", finished_at=utcnow())
    r = client_a.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "succeeded"


def test_list_jobs_paginates_with_after(api: Api, text_file: str) -> None:
    from api.services.keys import create_api_key

    with api.maker.begin() as s:
        c = api.client(create_api_key(s, f"pager-{api.key_a[-6:]}"))
    file_id = upload_rows(c, TEXT_ROWS)
    ids = [c.post("/v1/jobs", json=job_body(file_id)).json()["id"] for _ in range(5)]
    seen, after = [], None
    while True:
        params = {"limit": 2} | ({"after": after} if after else {})
        page = c.get("/v1/jobs", params=params).json()
        seen += [j["id"] for j in page["data"]]
        if not page["has_more"]:
            break
        after = page["next_cursor"]
    assert seen == ids[::-1]
    c.post(f"/v1/jobs/{ids[0]}/cancel")
    cancelled = c.get("/v1/jobs", params={"status": "cancelled"}).json()["data"]
    assert [j["id"] for j in cancelled] == [ids[0]]


def test_list_jobs_rejects_bad_query(client_a: httpx.Client) -> None:
    r = client_a.get("/v1/jobs", params={"limit": 0, "status": "nope"})
    assert r.status_code == 422
    assert {"limit", "status"} == set(_params(r))


def test_progress_percent_and_eta(api: Api, client_a: httpx.Client, text_file: str) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(text_file)).json()["id"]
    _set(
        api,
        job_id,
        status="running",
        step=25,
        total_steps=100,
        epoch=0.5,
        train_loss=1.5,
        training_started_at=utcnow() - timedelta(seconds=50),
    )
    job = client_a.get(f"/v1/jobs/{job_id}").json()
    assert job["progress"]["percent"] == 25.0
    assert 145 <= job["progress"]["eta_seconds"] <= 160  # 50 s for 25 steps, 75 to go
    assert job["metrics"]["train_loss"] == 1.5


def test_body_without_json_content_type_is_read_as_json(
    client_a: httpx.Client, text_file: str
) -> None:
    content = json.dumps(job_body(text_file)).encode()
    r = client_a.post(
        "/v1/jobs", content=content, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 201, r.text


def test_concurrent_requests_with_one_idempotency_key_make_one_job(
    client_a: httpx.Client, text_file: str
) -> None:
    headers = {"Idempotency-Key": f"race-{text_file}"}
    with ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(
                lambda _: client_a.post("/v1/jobs", json=job_body(text_file), headers=headers),
                range(8),
            )
        )
    assert {r.json()["id"] for r in responses} == {responses[0].json()["id"]}
    assert sorted(r.status_code for r in responses) == [200] * 7 + [201]


def test_dataset_path_json_array_under_data_root(api: Api, client_a: httpx.Client) -> None:
    data = api.settings.allowed_data_roots[0] / "array.json"
    data.write_text(json.dumps([{"text": "hello"}, {"text": "world"}, {"text": "again"}]))
    body = {"model": {"name_or_path": "org/m"}, "dataset": {"path": str(data)}}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    with api.session() as s:
        event = s.scalars(select(JobEvent).where(JobEvent.job_id == r.json()["id"])).one()
    assert event.data["train_rows"] == 3


def test_json_array_element_missing_field_names_row_and_field(
    api: Api, client_a: httpx.Client
) -> None:
    data = api.settings.allowed_data_roots[0] / "holes.json"
    data.write_text(json.dumps([{"text": "a"}, {"body": "b"}, {"text": "c"}]))
    body = {"model": {"name_or_path": "org/m"}, "dataset": {"path": str(data)}}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["details"] == [
        {"param": "dataset.text_field", "message": "row 2: missing field 'text'"}
    ]


def test_dataset_path_saved_by_datasets(api: Api, client_a: httpx.Client) -> None:
    saved = save_to_disk(api.settings.allowed_data_roots[0] / "saved", CHAT_ROWS, shards=2)
    body = {"model": {"name_or_path": "org/m"}, "dataset": {"path": str(saved), "format": "chat"}}
    assert client_a.post("/v1/jobs", json=body).status_code == 201
    (saved / "data-00001-of-00002.arrow").unlink()
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "dataset.path"
    assert "missing" in r.json()["error"]["message"]


def test_dataset_path_saved_by_datasets_cannot_link_outside(
    api: Api, client_a: httpx.Client
) -> None:
    outside = save_to_disk(api.roots / "outside-saved", CHAT_ROWS)
    saved = save_to_disk(api.settings.allowed_data_roots[0] / "linked", CHAT_ROWS)
    (saved / "data-00000-of-00001.arrow").unlink()
    (saved / "data-00000-of-00001.arrow").symlink_to(outside / "data-00000-of-00001.arrow")
    body = {"model": {"name_or_path": "org/m"}, "dataset": {"path": str(saved), "format": "chat"}}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    assert "points outside the directory" in r.json()["error"]["message"]
    link = api.settings.allowed_data_roots[0] / "link-to-outside"
    link.symlink_to(outside)
    r = client_a.post("/v1/jobs", json=body | {"dataset": {"path": str(link), "format": "chat"}})
    assert r.status_code == 422 and "outside the allowed roots" in r.json()["error"]["message"]


def _local_model(api: Api, name: str, **files: str) -> str:
    d = api.settings.allowed_model_roots[0] / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    for filename, text in files.items():
        (d / filename.replace("__", ".")).write_text(text)
    return str(d)


def test_chat_with_a_local_model_without_chat_template_is_422(
    api: Api, client_a: httpx.Client
) -> None:
    model = _local_model(api, "no-template", tokenizer_config__json='{"eos_token": "</s>"}')
    file_id = upload_rows(client_a, CHAT_ROWS)
    body = job_body(file_id, model={"name_or_path": model})
    body["dataset"]["format"] = "chat"
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["param"] == "dataset.format" and "chat template" in err["message"]


def test_chat_with_a_local_model_with_a_chat_template_is_accepted(
    api: Api, client_a: httpx.Client
) -> None:
    in_config = _local_model(
        api, "template-in-config", tokenizer_config__json=json.dumps({"chat_template": "{{ m }}"})
    )
    beside = _local_model(api, "template-beside", chat_template__jinja="{{ m }}")
    file_id = upload_rows(client_a, CHAT_ROWS)
    for model in (in_config, beside):
        body = job_body(file_id, model={"name_or_path": model})
        body["dataset"]["format"] = "chat"
        r = client_a.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text


def test_multi_machine_job_without_a_slurm_pool_is_a_422(client_a: httpx.Client,
                                                         text_file: str) -> None:
    body = job_body(text_file)
    body["distributed"] = {"strategy": "ddp", "num_processes": 2, "num_machines": 2}
    r = client_a.post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    assert _params(r) == ["distributed.num_machines"]
    assert "no SLURM pool" in r.json()["error"]["details"][0]["message"]


def test_a_job_slurm_holds_back_says_so_in_its_one_waiting_field(
        api: Api, client_a: httpx.Client, text_file: str) -> None:
    job_id = client_a.post("/v1/jobs", json=job_body(text_file)).json()["id"]
    _set(api, job_id, status="running", started_at=utcnow(), attempt=1,
         waiting_for="SLURM pending: Resources")
    job = client_a.get(f"/v1/jobs/{job_id}").json()
    assert "waiting_for" not in job  # the scheduler's and SLURM's reasons share `queue`
    assert job["queue"] == {"position": None, "waiting_for": "slurm",
                            "message": "SLURM pending: Resources"}
    _set(api, job_id, waiting_for=None)
    assert client_a.get(f"/v1/jobs/{job_id}").json()["queue"] is None
