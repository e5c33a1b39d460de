"""Schemathesis against the service's own OpenAPI document, on the live server with a valid
key and PostgreSQL (the production database, the stricter one): no 500, every response and
status as documented. Bounded for CI; bench/fuzz_api.py runs a larger version.

Half of the generated cases that name a job or a file get a real one of the caller's, so
the code behind a found object (logs, checkpoints, adapter zips, cancel, delete) is fuzzed
too, not only its 404."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from api.main import create_app
from core.infra.settings import Settings
from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows

MAX_EXAMPLES = 25
CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]

# The document is the app's own; building it opens nothing (no lifespan).
schema = schemathesis.openapi.from_dict(create_app(Settings()).openapi())


@pytest.fixture(scope="module")
def db_url(pg_url: str) -> str:
    return pg_url


@pytest.fixture(scope="module")
def real_ids(api: Api) -> dict[str, list[str]]:
    """Objects of tenant A for the fuzzer to hit: a file, a queued job and a succeeded one
    with log, checkpoints and adapter, webhook endpoints."""
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    queued = client.post("/v1/jobs", json=job_body(file_id)).json()["id"]
    done = client.post("/v1/jobs", json=job_body(file_id)).json()["id"]
    fake_run(api, done, status="succeeded", log_lines=50, checkpoints=(5, 10), adapter=True)
    # A public address: registration checks it without calling it, and no sender runs here.
    hooks = [client.post("/v1/webhooks", json={"url": f"https://93.184.215.14/{i}"}).json()["id"]
             for i in range(2)]
    return {"job_id": [queued, done], "file_id": [upload_rows(client, TEXT_ROWS), file_id],
            "webhook_id": hooks}


@schema.parametrize()
@schema.given(data=st.data())
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases on every CI run; the bench script explores
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_api_matches_its_openapi_and_never_errs(
    case: schemathesis.Case, data: st.DataObject, api: Api, real_ids: dict[str, list[str]]
) -> None:
    for name, ids in real_ids.items():
        if name in (case.path_parameters or {}) and data.draw(st.booleans(), label="real"):
            case.path_parameters[name] = data.draw(st.sampled_from(ids), label=name)
    case.call_and_validate(
        base_url=api.url,
        headers={"Authorization": f"Bearer {api.key_a}"},
        checks=CHECKS,
        timeout=30,
    )


# --------------------------------------------------------------------------- what fuzzing found


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/%00",
        "/v1/files/%00",
        "/v1/jobs/job-%00/events",
        "/v1/jobs/" + "x" * 5000,
    ],
)
def test_ids_that_cannot_exist_are_404(api: Api, path: str) -> None:
    r = api.client(api.key_a).get(path)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "path, param",
    [
        ("/v1/jobs?after=%00", "after"),
        ("/v1/files?after=%00", "after"),
        (f"/v1/jobs/{{job}}/events?after={2**63}", "after"),
        (f"/v1/jobs/{{job}}/adapter?checkpoint={2**31}", "checkpoint"),
    ],
)
def test_numbers_and_cursors_the_database_cannot_hold_are_422(
    api: Api, real_ids: dict[str, list[str]], path: str, param: str
) -> None:
    r = api.client(api.key_a).get(path.format(job=real_ids["job_id"][1]))
    assert r.status_code == 422 and r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "content, status",
    [
        (b"\x80\x81not utf-8", 422),
        (b'{"model": NaN}', 422),
        (b'{"a": Infinity}', 422),
        (b"[" * 100_000 + b"]" * 100_000, 422),
        (b'{"name": "' + b"x" * (1 << 20) + b'"}', 413),
    ],
)
def test_job_bodies_that_are_not_plain_json(api: Api, content: bytes, status: int) -> None:
    headers = {"Content-Type": "application/json"}
    r = api.client(api.key_a).post("/v1/jobs", content=content, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "body"


def test_nul_characters_in_a_spec_are_422_with_their_field(
    api: Api, real_ids: dict[str, list[str]]
) -> None:
    body = job_body(real_ids["file_id"][1], name="a\x00b")
    body["peft"] = {"target_modules": ["q_proj", "v\x00"]}
    r = api.client(api.key_a).post("/v1/jobs", json=body)
    assert r.status_code == 422, r.text
    params = [d["param"] for d in r.json()["error"]["details"]]
    assert params == ["name", "peft.target_modules[1]"]


def test_a_dataset_column_named_with_nul_is_refused(api: Api) -> None:
    r = api.client(api.key_a).post(
        "/v1/files", files={"file": ("d.jsonl", b'{"te\\u0000xt": "a"}\n', "text/plain")}
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_dataset"
