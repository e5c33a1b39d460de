"""GET /v1/fine_tuning/jobs: newest first, pages by ``after``, metadata filters read from the
job_metadata index. Through the official SDK against the API alone (jobs recorded, not run)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest

from core.infra.settings import Settings
from core.spec.catalog import CatalogModel
from tests.utils.api import Api, upload_rows
from tests.utils.tiny import chat_rows


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings, tiny_causal_lm: Path) -> Settings:
    model = api_settings.allowed_model_roots[0] / "tiny-llama"
    shutil.copytree(tiny_causal_lm, model)
    return api_settings.model_copy(update={
        "model_catalog": {"tiny": CatalogModel(location=str(model))}})


@pytest.fixture(scope="module")
def jobs(api: Api) -> dict[str, str]:
    """Tenant A's jobs, oldest first, and one of tenant B with A's metadata."""
    made = {}
    for key, tenant_key, metadata in (
        ("x1", api.key_a, {"team": "x", "run": "1"}),
        ("y", api.key_a, {"team": "y"}),
        ("x2", api.key_a, {"team": "x", "run": "2"}),
        ("none", api.key_a, None),
        ("other", api.key_b, {"team": "x", "run": "1"}),
    ):
        sdk = openai.OpenAI(base_url=f"{api.url}/v1", api_key=tenant_key, max_retries=0)
        train = upload_rows(api.client(tenant_key), chat_rows(8))
        made[key] = sdk.fine_tuning.jobs.create(model="tiny", training_file=train,
                                                metadata=metadata).id
    return made


def _ids(client: httpx.Client, **params: str | int) -> tuple[list[str], bool]:
    r = client.get("/v1/fine_tuning/jobs", params=params)
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()["data"]], r.json()["has_more"]


def test_a_metadata_filter_pages_through_the_tenants_matches_newest_first(
    api: Api, jobs: dict[str, str]
) -> None:
    client = api.client(api.key_a)
    assert _ids(client, **{"metadata[team]": "x"}) == ([jobs["x2"], jobs["x1"]], False)
    first = _ids(client, limit=1, **{"metadata[team]": "x"})
    assert first == ([jobs["x2"]], True)
    assert _ids(client, limit=1, after=jobs["x2"], **{"metadata[team]": "x"}) == (
        [jobs["x1"]], False)


def test_every_pair_of_a_filter_must_match(api: Api, jobs: dict[str, str]) -> None:
    client = api.client(api.key_a)
    assert _ids(client, **{"metadata[team]": "x", "metadata[run]": "1"}) == ([jobs["x1"]], False)
    assert _ids(client, **{"metadata[team]": "y", "metadata[run]": "1"}) == ([], False)


def test_a_filter_no_job_could_hold_matches_nothing(api: Api, jobs: dict[str, str]) -> None:
    client = api.client(api.key_a)
    assert _ids(client, **{"metadata[team]": "x" * 513}) == ([], False)
    assert _ids(client, **{"metadata[team]": "x\x00"}) == ([], False)


def test_without_a_filter_every_job_of_the_tenant_pages_by_after(
    api: Api, jobs: dict[str, str]
) -> None:
    client = api.client(api.key_a)
    newest, more = _ids(client, limit=2)
    assert newest == [jobs["none"], jobs["x2"]] and more
    rest, _ = _ids(client, limit=2, after=jobs["x2"])
    assert rest == [jobs["y"], jobs["x1"]]
    assert jobs["other"] not in _ids(client, limit=100)[0]


def test_events_page_newest_first_by_after(api: Api, jobs: dict[str, str]) -> None:
    from core.db.models import JobEvent, utcnow

    job_id = jobs["y"]
    with api.session() as s:
        s.add_all(JobEvent(job_id=job_id, type="progress", message=f"step {k}", data={"step": k},
                           created_at=utcnow()) for k in range(5))
        s.commit()
    sdk = openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key_a, max_retries=0)
    first = sdk.fine_tuning.jobs.list_events(job_id, limit=2)
    assert [e.message for e in first.data] == ["step 4", "step 3"] and first.has_more
    rest = sdk.fine_tuning.jobs.list_events(job_id, limit=10, after=first.data[-1].id)
    assert [e.message for e in rest.data][:3] == ["step 2", "step 1", "step 0"]
    assert not rest.has_more
