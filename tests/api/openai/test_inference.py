"""The inference routes' answers that need no engine: what is refused before a deployment is
asked for, and the 503s while none can answer (OpenAI's shapes). The engine itself is
tests/e2e/test_serving.py's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from core.db.models import Job, JobStatus, Tenant, utcnow
from core.infra.settings import Settings
from core.serving.deployments import SERVING_CAPABILITY
from core.serving.tables import Deployment, DeploymentState
from tests.utils.api import Api, one_model_settings
from worker.upkeep.registry import Inventory, register

BASE = "tiny"


@pytest.fixture(scope="module")
def api_settings(tmp_path_factory: pytest.TempPathFactory, db_url: str) -> Settings:
    return one_model_settings(tmp_path_factory.mktemp("ftune"), db_url, BASE)


def chat(client: httpx.Client, model: object, **body: object) -> httpx.Response:
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], **body})


def test_without_an_engine_inference_is_a_503_naming_the_make_target(api: Api) -> None:
    r = chat(api.client(api.key_a), BASE)
    assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_unavailable"
    assert "make engine" in err["message"]


def test_an_unknown_model_is_model_not_found(api: Api) -> None:
    for model in ("gpt-4o", "ft:tiny:acme::job-000000000000000000000000", "job-nope"):
        r = chat(api.client(api.key_a), model)
        assert r.status_code == 404, r.text
        assert r.json()["error"] | {"message": ""} == {
            "message": "", "type": "invalid_request_error", "param": "model",
            "code": "model_not_found"}


def test_a_request_without_a_model_names_the_parameter(api: Api) -> None:
    c = api.client(api.key_a)
    for body in ({"messages": []}, {"model": 3, "messages": []}):
        r = c.post("/v1/completions", json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "model")
    r = c.post("/v1/chat/completions", content=b"[1, 2]")
    assert (r.status_code, r.json()["error"]["param"]) == (400, "body")


def test_another_tenants_fine_tuned_model_is_not_found(api: Api, tmp_path: Path) -> None:
    with api.session() as s:
        owner = s.scalars(select(Tenant).where(Tenant.name.like("tenant-b-%"))).one()
        (tmp_path / "adapter").mkdir()
        (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
        job = Job(tenant_id=owner.id, status=JobStatus.succeeded, name="x",
                  spec={"model": {"name_or_path": "/m"}}, job_dir=str(tmp_path),
                  adapter_path="adapter", finished_at=utcnow())
        s.add(job)
        s.commit()
        owners_name = f"ft:m:{owner.name}:x:{job.id}"
    mine, theirs = api.client(api.key_b), api.client(api.key_a)
    assert chat(mine, owners_name).status_code == 503  # found: no engine to serve it
    for name in (owners_name, job.id, f"{owners_name}:ckpt-step-1"):
        assert chat(theirs, name).json()["error"]["code"] == "model_not_found", name
    assert chat(mine, f"{owners_name}:ckpt-step-1").status_code == 404  # no such checkpoint
    assert theirs.delete(f"/v1/models/{owners_name}").status_code == 404


def test_a_starting_deployment_answers_503_with_retry_after(api: Api) -> None:
    with api.session() as s:
        register(s, "serving-worker", Inventory("h", [], 2, {SERVING_CAPABILITY: True}, 1))
        s.commit()
    r = chat(api.client(api.key_a), BASE)
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "deployment_starting"
    with api.session() as s:
        (dep,) = s.scalars(select(Deployment)).all()
        assert (dep.kind, dep.state) == ("base", DeploymentState.requested)


def test_only_fine_tuned_models_can_be_deleted(api: Api) -> None:
    r = api.client(api.key_a).delete(f"/v1/models/{BASE}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
