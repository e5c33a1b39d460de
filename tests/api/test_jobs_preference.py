"""POST/GET /v1/jobs for preference objectives: row checks at submit, the chat template of
messages prompts, the cross-field rules in one 422, and the job object's rewards."""

from __future__ import annotations

import json
from typing import Any

import httpx
from sqlalchemy import update

from core.db.models import Job
from tests.utils.api import Api, job_body, upload_rows

PAIRS = [{"prompt": f"q {i}", "chosen": "good", "rejected": "bad"} for i in range(4)]


def dpo_body(file_id: str, **training: Any) -> dict[str, Any]:
    body = job_body(file_id, training={"objective": "dpo", "max_steps": 5, **training})
    body["dataset"]["format"] = "preference"
    return body


def details(r: httpx.Response) -> list[dict[str, str]]:
    assert r.status_code == 422, r.text
    return list(r.json()["error"]["details"])


def test_dpo_job_is_accepted_and_shows_its_rewards(api: Api, client_a: httpx.Client) -> None:
    r = client_a.post("/v1/jobs", json=dpo_body(upload_rows(client_a, PAIRS)))
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["metrics"]["preference"] is None
    rewards = {"reward_chosen": 0.5, "reward_rejected": -0.5, "reward_margin": 1.0,
               "reward_accuracy": 1.0}
    with api.session() as s:
        s.execute(update(Job).where(Job.id == job["id"]).values(preference_metrics=rewards))
        s.commit()
    assert client_a.get(f"/v1/jobs/{job['id']}").json()["metrics"]["preference"] == rewards


def test_bad_pairs_are_named_by_row_and_field(client_a: httpx.Client) -> None:
    rows = [
        {"prompt": "fine", "chosen": "a", "rejected": "b"},
        {"prompt": "no chosen", "rejected": "b"},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
        {"prompt": "  ", "chosen": "a", "rejected": "b"},
    ]
    got = details(client_a.post("/v1/jobs", json=dpo_body(upload_rows(client_a, rows))))
    assert {"param": "dataset.chosen_field", "message": "row 2: missing field 'chosen'"} in got
    assert {
        "param": "dataset.rejected_field",
        "message": "row 3: field 'rejected': identical to 'chosen': a pair must prefer one "
        "answer over a different one",
    } in got
    assert {"param": "dataset.prompt_field", "message": "row 4: field 'prompt': empty text"} in got


def test_kto_label_must_be_boolean(client_a: httpx.Client) -> None:
    rows = [{"prompt": "p", "completion": "c", "label": v} for v in (True, "false", 1, "yes")]
    body = job_body(
        upload_rows(client_a, rows),
        training={"objective": "kto", "per_device_train_batch_size": 2},
    )
    body["dataset"]["format"] = "kto"
    got = details(client_a.post("/v1/jobs", json=body))
    assert [d["message"] for d in got] == [
        "row 3: field 'label': must be true or false, got 1",
        "row 4: field 'label': must be true or false, got 'yes'",
    ]
    assert {d["param"] for d in got} == {"dataset.label_field"}


def test_objective_and_format_rules_come_in_one_422(client_a: httpx.Client) -> None:
    file_id = upload_rows(client_a, PAIRS)
    body = dpo_body(file_id, preference={"desirable_weight": 2.0})
    body["model"]["task"] = "seq_cls"
    body["peft"] = {"method": "prompt_tuning"}
    got = {d["param"] for d in details(client_a.post("/v1/jobs", json=body))}
    assert {"training.objective", "peft.method", "training.preference.desirable_weight"} <= got
    sft = job_body(file_id)
    sft["dataset"]["format"] = "preference"
    (only,) = details(client_a.post("/v1/jobs", json=sft))
    assert only["param"] == "dataset.format" and "objective dpo or orpo" in only["message"]


def test_messages_prompts_need_a_chat_template(api: Api, client_a: httpx.Client) -> None:
    d = api.settings.allowed_model_roots[0] / "pref-no-template"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    chat = [{"prompt": [{"role": "user", "content": f"q {i}"}], "chosen": "good",
             "rejected": "bad"} for i in range(4)]
    body = dpo_body(upload_rows(client_a, chat))
    body["model"] = {"name_or_path": str(d)}
    (only,) = details(client_a.post("/v1/jobs", json=body))
    assert only["param"] == "dataset.format" and "chat template" in only["message"]
    body["dataset"]["file_id"] = upload_rows(client_a, PAIRS)  # text prompts need none
    assert client_a.post("/v1/jobs", json=body).status_code == 201
