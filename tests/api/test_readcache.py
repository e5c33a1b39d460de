"""Kept job bodies (api/readcache.py, served by ServePolledJobs,
api/middleware/polled_jobs.py): a repeated GET /v1/jobs/{id} is answered without a read
while nothing was committed since, never after a commit, never past its age, never to
another tenant or a key that is not trusted, and is logged and counted as the route's
answer."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from typing import Any, Self

import httpx
import pytest
from sqlalchemy import Engine, event

from api import readcache
from api.readcache import ReadCache, Version
from api.services.keys import create_api_key, hash_key
from core.infra.settings import Settings
from testkit.wait import wait_until
from tests.utils.api import TEXT_ROWS, Api, job_body, set_step, upload_rows

MAX_AGE = 30.0  # long: a test that wants a body past its age moves the cache's clock


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    return api_settings.model_copy(update={"job_read_cache_seconds": MAX_AGE})


@pytest.fixture(scope="module")
def job_id(api: Api) -> str:
    c = api.client(api.key_a)
    r = c.post("/v1/jobs", json=job_body(upload_rows(c, TEXT_ROWS)))
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


class Reads:
    """The statements run on the API's event-loop read connection while counting."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.statements: list[str] = []

    def _count(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.statements.append(statement)

    def __enter__(self) -> Self:
        event.listen(self.engine, "before_cursor_execute", self._count)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._count)


def read_engine(api: Api) -> Engine:
    """The API's event-loop read connection, where its job reads run (SQLite)."""
    return api.app.state.loop_reads.engine  # type: ignore[no-any-return]


@pytest.fixture
def reads(api: Api) -> Iterator[Reads]:
    with Reads(read_engine(api)) as r:
        yield r


# --------------------------------------------------------------------------- over HTTP


def test_an_unchanged_job_is_answered_again_without_a_read(api: Api, job_id: str) -> None:
    c = api.client(api.key_a)
    first = c.get(f"/v1/jobs/{job_id}")
    with Reads(read_engine(api)) as counted:
        again = c.get(f"/v1/jobs/{job_id}")
    assert first.status_code == again.status_code == 200
    assert counted.statements == []
    assert again.content == first.content
    assert again.headers["content-type"] == first.headers["content-type"] == "application/json"
    assert again.json()["id"] == job_id


def test_a_commit_anywhere_ends_the_kept_body(api: Api, job_id: str, reads: Reads) -> None:
    c = api.client(api.key_a)
    set_step(api.maker, job_id, 1)
    assert c.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 1
    set_step(api.maker, job_id, 2)
    assert c.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] == 2
    assert len(reads.statements) == 2  # one read after each commit, none kept across it


def test_a_body_past_its_age_is_read_again(
    api: Api, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = api.client(api.key_a)
    c.get(f"/v1/jobs/{job_id}")
    later = time.monotonic() + MAX_AGE + 1
    monkeypatch.setattr(readcache, "monotonic", lambda: later)
    with Reads(read_engine(api)) as counted:
        assert c.get(f"/v1/jobs/{job_id}").status_code == 200
    assert len(counted.statements) == 1


def test_another_tenant_is_never_answered_with_a_kept_body(api: Api, job_id: str) -> None:
    assert api.client(api.key_a).get(f"/v1/jobs/{job_id}").status_code == 200
    b = api.client(api.key_b)
    # The first with a key new to the API goes to the route; the next is answered before it.
    assert [b.get(f"/v1/jobs/{job_id}").status_code for _ in range(2)] == [404, 404]
    assert b.get("/v1/jobs/job-nope").json()["error"]["param"] == "job_id"


def test_a_job_answered_before_the_routing_is_what_the_route_answers(
    api: Api, job_id: str
) -> None:
    with api.maker.begin() as s:  # a key the API has not verified yet: its route answers
        key = create_api_key(s, "tenant-of-a-new-key", "tests")
    client = httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"})
    with client as c:
        mine = c.post("/v1/jobs", json=job_body(upload_rows(c, TEXT_ROWS))).json()["id"]
        api.app.state.key_cache.drop(hash_key(key))
        by_route = c.get(f"/v1/jobs/{mine}")
        kept, api.app.state.read_cache = api.app.state.read_cache, None
        try:  # read again, not kept: ServePolledJobs reads it
            before_routing = c.get(f"/v1/jobs/{mine}")
        finally:
            api.app.state.read_cache = kept
    assert by_route.status_code == before_routing.status_code == 200
    assert before_routing.headers["content-type"] == by_route.headers["content-type"]
    assert before_routing.json() == by_route.json()


def test_a_read_that_fails_before_the_routing_is_read_again_by_the_route(
    api: Api, job_id: str
) -> None:
    failed: list[str] = []

    def fail_once(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not failed:
            failed.append(statement)
            raise sqlite3.OperationalError("disk I/O error")  # not a lock: no retry there

    set_step(api.maker, job_id, 5)  # nothing kept: the next GET reads
    c = api.client(api.key_a)
    event.listen(read_engine(api), "before_cursor_execute", fail_once)
    try:
        r = c.get(f"/v1/jobs/{job_id}")
    finally:
        event.remove(read_engine(api), "before_cursor_execute", fail_once)
    assert len(failed) == 1
    assert r.status_code == 200 and r.json()["progress"]["step"] == 5


@pytest.mark.parametrize("authorization", [None, "Basic x", "Bearer ft_unknown_" + "k" * 24])
def test_a_request_without_a_trusted_key_is_refused_though_a_body_is_kept(
    api: Api, job_id: str, authorization: str | None
) -> None:
    assert api.client(api.key_a).get(f"/v1/jobs/{job_id}").status_code == 200
    headers = {"Authorization": authorization} if authorization else {}
    assert httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=headers).status_code == 401


def test_a_key_due_for_verification_goes_to_its_route_to_be_verified(
    api: Api, job_id: str
) -> None:
    """A key due for its re-verification is not answered from a kept body: its route
    verifies it in the background while it answers, so the key's entry is renewed before
    it expires. (Answered from kept bodies alone, the entry would expire under the
    requests, which would then all wait for one verification: api/services/keys.py
    KeyCache.)"""
    c = api.client(api.key_a)
    assert c.get(f"/v1/jobs/{job_id}").status_code == 200  # read and kept
    cache, key_hash = api.app.state.key_cache, hash_key(api.key_a)
    ttl = api.settings.api_key_cache_seconds
    tenant, _ = cache._entries[key_hash]
    due = time.monotonic() + 0.45 * ttl  # valid, but past half its life: due
    cache._entries[key_hash] = (tenant, due)
    assert c.get(f"/v1/jobs/{job_id}").status_code == 200
    wait_until(lambda: cache._entries[key_hash][1] != due, 5, "the entry verified again",
               every=0.02)
    assert cache._entries[key_hash][1] > due  # verified again: renewed


def test_kept_answers_are_logged_and_counted_as_the_route(
    api: Api, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = api.client(api.key_a)
    c.get(f"/v1/jobs/{job_id}")

    def counted() -> float:
        metrics = httpx.get(api.url + "/metrics").text
        line = next(m for m in metrics.splitlines() if m.startswith("ftune_http_requests_total{")
                    and 'route="/v1/jobs/{job_id}"' in m and 'status="200"' in m)
        return float(line.rsplit(" ", 1)[1])

    before = counted()
    with (caplog.at_level("INFO", logger="ftune.api.request"),
          Reads(read_engine(api)) as reads):
        assert c.get(f"/v1/jobs/{job_id}").status_code == 200
    assert reads.statements == []  # a kept answer
    assert counted() == before + 1
    line = [r for r in caplog.records if r.name == "ftune.api.request"][-1]
    assert line.getMessage() == "GET /v1/jobs/{job_id} 200"
    assert getattr(line, "route", None) == "/v1/jobs/{job_id}"


# --------------------------------------------------------------------------- the cache


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(readcache, "monotonic", c)
    return c


K = ("tenant", "job")


def test_a_body_is_kept_for_its_version_only(clock: Clock) -> None:
    version = [1]
    cache = ReadCache(lambda job_id: Version.of(version[0]), max_age=1.0)
    cache.put(K, cache.version("job"), b"one", own_rows_only=True)
    assert cache.get(K, cache.version("job")) == b"one"
    version[0] = 2
    assert cache.get(K, cache.version("job")) is None
    assert len(cache) == 0  # a stale body is dropped when found


def test_a_body_of_its_own_rows_outlives_commits_to_other_rows(clock: Clock) -> None:
    own, any_ = [1], [1]
    cache = ReadCache(lambda job_id: Version(own[0], any_[0]), max_age=1.0)
    cache.put(K, cache.version("job"), b"running", own_rows_only=True)
    cache.put(("tenant", "queued"), cache.version("queued"), b"queued", own_rows_only=False)
    any_[0] = 2  # another job's commit
    assert cache.get(K, cache.version("job")) == b"running"
    assert cache.get(("tenant", "queued"), cache.version("queued")) is None
    own[0] = 2  # a commit to its own rows
    assert cache.get(K, cache.version("job")) is None


def test_a_body_is_kept_until_its_age(clock: Clock) -> None:
    cache = ReadCache(lambda job_id: Version.of(1), max_age=1.0)
    cache.put(K, Version.of(1), b"one", own_rows_only=True)
    clock.now += 1.0
    assert cache.get(K, cache.version("job")) == b"one"
    clock.now += 0.01
    assert cache.get(K, cache.version("job")) is None


def test_the_oldest_body_goes_past_the_bound(clock: Clock) -> None:
    cache = ReadCache(lambda job_id: Version.of(1), max_age=1.0, max_entries=2)
    a, b, c, v = ("t", "a"), ("t", "b"), ("t", "c"), Version.of(1)
    cache.put(a, v, b"a", own_rows_only=True)
    cache.put(b, v, b"b", own_rows_only=True)
    cache.put(a, v, b"a2", own_rows_only=True)  # kept again: now the newest
    cache.put(c, v, b"c", own_rows_only=True)
    assert (cache.get(a, v), cache.get(b, v), cache.get(c, v)) == (b"a2", None, b"c")


def test_a_body_read_across_a_commit_is_never_served(clock: Clock) -> None:
    """The version is taken before the read: a commit during the read makes the next
    lookup a miss, even though the body may hold the commit's data."""
    version = [1]
    cache = ReadCache(lambda job_id: Version.of(version[0]), max_age=1.0)
    before = cache.version("job")
    version[0] = 2  # committed while the read ran
    cache.put(K, before, b"read", own_rows_only=True)
    assert cache.get(K, cache.version("job")) is None
