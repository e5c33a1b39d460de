"""Another tenant's objects do not exist for you: 404, never 403."""

from __future__ import annotations

import httpx
import pytest

from tests.api.jobfixtures import fake_run
from tests.utils.api import TEXT_ROWS, Api, job_body, upload_rows


@pytest.fixture(scope="module")
def a_objects(api: Api) -> tuple[str, str]:
    c = api.client(api.key_a)
    file_id = upload_rows(c, TEXT_ROWS)
    job_id = c.post("/v1/jobs", json=job_body(file_id)).json()["id"]
    fake_run(api, job_id, status="succeeded", log_lines=5, checkpoints=(2,), adapter=True,
             launched=True)
    return file_id, job_id


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/files/{file}"),
        ("DELETE", "/v1/files/{file}"),
        ("GET", "/v1/jobs/{job}"),
        ("POST", "/v1/jobs/{job}/cancel"),
        ("GET", "/v1/jobs/{job}/events"),
        ("GET", "/v1/jobs/{job}/checkpoints"),
        ("GET", "/v1/jobs/{job}/logs"),
        ("GET", "/v1/jobs/{job}/launch"),
        ("GET", "/v1/jobs/{job}/adapter"),
        ("GET", "/v1/jobs/{job}/adapter?checkpoint=2"),
    ],
)
def test_other_tenants_objects_are_404(
    client_a: httpx.Client,
    client_b: httpx.Client,
    a_objects: tuple[str, str],
    method: str,
    path: str,
) -> None:
    file_id, job_id = a_objects
    url = path.format(file=file_id, job=job_id)
    r = client_b.request(method, url)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "not_found"
    # The same object exists for its owner: the 404 above is tenancy, not a missing object.
    assert client_a.request("GET", url.split("?")[0].replace("/cancel", "")).status_code == 200


def test_other_tenants_objects_are_not_listed(
    client_b: httpx.Client, a_objects: tuple[str, str]
) -> None:
    file_id, job_id = a_objects
    assert job_id not in [j["id"] for j in client_b.get("/v1/jobs").json()["data"]]
    assert file_id not in [f["id"] for f in client_b.get("/v1/files").json()["data"]]


def test_other_tenants_file_cannot_be_trained_on(
    client_b: httpx.Client, a_objects: tuple[str, str]
) -> None:
    r = client_b.post("/v1/jobs", json=job_body(a_objects[0]))
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "dataset.file_id"


def test_other_tenants_job_cannot_anchor_a_page(
    client_b: httpx.Client, a_objects: tuple[str, str]
) -> None:
    r = client_b.get("/v1/jobs", params={"after": a_objects[1]})
    assert r.status_code == 422 and r.json()["error"]["param"] == "after"
