"""/metrics read from the database at scrape time: queue, run times, heartbeats, tokens/s."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update

from core.db.models import Job, JobStatus, utcnow
from core.jobs import state as jobstate
from core.jobs.state import Holder
from tests.utils.api import TEXT_ROWS, Api, job_body, migrated_sqlite_url, upload_rows


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    if request.param == "postgres":
        return str(request.getfixturevalue("fresh_pg_url"))
    return migrated_sqlite_url(tmp_path_factory)


def scrape(api: Api) -> dict[str, list[tuple[dict[str, str], float]]]:
    """{sample name: [(labels, value)]}."""
    r = httpx.get(api.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    found = [v for ls, v in samples.get(name, []) if ls == labels]
    assert len(found) == 1, (name, labels, samples.get(name))
    return float(found[0])


@pytest.fixture(scope="module")
def jobs(api: Api) -> dict[str, str]:
    """Jobs in every state the metrics read, with times relative to now."""
    client = api.client(api.key_a)
    file_id = upload_rows(client, TEXT_ROWS)
    names = ["queued_old", "queued_new", "run_a", "run_b", "cancelling", "ok", "failed_old",
             "cancelled", "cancelled_unstarted"]  # fmt: skip
    ids = {n: client.post("/v1/jobs", json=job_body(file_id)).json()["id"] for n in names}
    now = utcnow()

    def ago(seconds: float) -> datetime:
        return now - timedelta(seconds=seconds)

    # Each job moved by the state machine (which keeps the counts by status), then its
    # times set.
    claimed = {"run_a": "gpu-1", "run_b": "gpu-1", "cancelling": "gpu-2", "ok": "gpu-3",
               "failed_old": "gpu-3", "cancelled": "gpu-3"}
    finished = {"ok": JobStatus.succeeded, "failed_old": JobStatus.failed,
                "cancelled": JobStatus.cancelled}
    values: dict[str, dict[str, Any]] = {
        "queued_old": {"queued_at": ago(120)},
        "run_a": {"started_at": ago(600), "heartbeat_at": ago(30), "tokens_per_second": 1234.5},
        "run_b": {"started_at": ago(60), "heartbeat_at": ago(5), "tokens_per_second": None},
        "cancelling": {"started_at": ago(900), "heartbeat_at": ago(90), "tokens_per_second": 99.0},
        "ok": {"started_at": ago(600), "finished_at": ago(60)},
        "failed_old": {"started_at": ago(9000), "finished_at": ago(5400)},
        "cancelled": {"started_at": ago(200), "finished_at": ago(100)},
        "cancelled_unstarted": {"started_at": None, "finished_at": ago(10)},
    }  # fmt: skip
    with api.session() as s:
        for name, worker in claimed.items():
            assert jobstate.claim(s, ids[name], worker_id=worker, max_attempts=3, now=now)
        assert jobstate.request_cancel(s, ids["cancelling"], previous="running", now=now)
        assert jobstate.request_cancel(s, ids["cancelled_unstarted"], previous="queued", now=now)
        for name, to in finished.items():
            assert jobstate.finish(s, ids[name], Holder(claimed[name], 1), previous="running",
                                   to=to, now=now)
        for name, v in values.items():
            s.execute(update(Job).where(Job.id == ids[name]).values(**v))
        s.commit()
    return ids


def test_queue_depth_and_oldest_age(api: Api, jobs: dict[str, str]) -> None:
    m = scrape(api)
    assert value(m, "ftune_queue_depth") == 2
    assert value(m, "ftune_jobs", status="queued") == 2
    assert 120 <= value(m, "ftune_queue_oldest_age_seconds") < 180


def test_job_durations_of_the_last_hour_by_status(api: Api, jobs: dict[str, str]) -> None:
    m = scrape(api)
    assert value(m, "ftune_job_duration_seconds_count", status="succeeded") == 1
    assert value(m, "ftune_job_duration_seconds_sum", status="succeeded") == pytest.approx(
        540, abs=1
    )
    assert value(m, "ftune_job_duration_seconds_bucket", status="succeeded", le="300.0") == 0
    assert value(m, "ftune_job_duration_seconds_bucket", status="succeeded", le="900.0") == 1
    assert value(m, "ftune_job_duration_seconds_bucket", status="succeeded", le="+Inf") == 1
    # The failed job finished 1.5 h ago; the unstarted cancel has no run time.
    assert value(m, "ftune_job_duration_seconds_count", status="failed") == 0
    assert value(m, "ftune_job_duration_seconds_count", status="cancelled") == 1
    assert value(m, "ftune_job_duration_seconds_bucket", status="cancelled", le="60.0") == 0
    assert value(m, "ftune_job_duration_seconds_bucket", status="cancelled", le="300.0") == 1


def test_heartbeat_age_per_worker_is_its_latest(api: Api, jobs: dict[str, str]) -> None:
    m = scrape(api)
    workers = {ls["worker"]: v for ls, v in m["ftune_worker_heartbeat_age_seconds"]}
    assert set(workers) == {"gpu-1", "gpu-2"}
    assert 5 <= workers["gpu-1"] < 60  # run_b's 5 s, not run_a's 30 s
    assert 90 <= workers["gpu-2"] < 150


def test_tokens_per_second_of_running_jobs(api: Api, jobs: dict[str, str]) -> None:
    m = scrape(api)
    assert m["ftune_job_tokens_per_second"] == [({"job_id": jobs["run_a"]}, 1234.5)]


def test_metrics_follow_the_database(api: Api, jobs: dict[str, str]) -> None:
    client = api.client(api.key_a)
    job_id = client.post("/v1/jobs", json=job_body(upload_rows(client, TEXT_ROWS))).json()["id"]
    with api.session() as s:
        assert jobstate.claim(s, job_id, worker_id="gpu-4", max_attempts=3, now=utcnow())
        s.execute(update(Job).where(Job.id == job_id).values(tokens_per_second=10.0))
        s.commit()
    m = scrape(api)
    assert value(m, "ftune_job_tokens_per_second", job_id=job_id) == 10.0
    assert value(m, "ftune_jobs", status="running") == 3
    with api.session() as s:
        assert jobstate.finish(s, job_id, Holder("gpu-4", 1), previous="running",
                               to=JobStatus.succeeded, now=utcnow())
        s.commit()
    m = scrape(api)
    assert [ls["job_id"] for ls, _ in m["ftune_job_tokens_per_second"]] == [jobs["run_a"]]
    assert value(m, "ftune_job_duration_seconds_count", status="succeeded") == 2
    assert value(m, "ftune_jobs", status="running") == 2
    assert value(m, "ftune_jobs", status="succeeded") == 2
    workers = {ls["worker"] for ls, _ in m["ftune_worker_heartbeat_age_seconds"]}
    assert workers == {"gpu-1", "gpu-2"}  # gpu-4 holds nothing now
