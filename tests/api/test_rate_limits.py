"""Inference rate limits per API key (api/services/rate_limits.py), over HTTP with the official
SDK: a key past its requests a minute gets OpenAI's 429 with Retry-After, counted in the
database, so a second API process over the same database refuses it too. The limit applies
before any engine is asked for: no engine is needed here."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import openai
import pytest
from sqlalchemy.orm import sessionmaker

from api.errors import RetryLater
from api.main import create_app
from api.services import keys, rate_limits
from api.services.keys import create_api_key
from core.db.models import RateWindow, utcnow
from core.db.session import make_engine
from core.infra.settings import Settings
from core.spec.catalog import CatalogModel
from testkit.wait import wait_until
from tests.utils.api import Api, ServerThread

BASE = "tiny"
PER_MINUTE = 2


@pytest.fixture(scope="module")
def api_settings(api_settings: Settings) -> Settings:
    location = str(api_settings.allowed_model_roots[0] / "tiny")
    return api_settings.model_copy(update={
        "model_catalog": {BASE: CatalogModel(location=location)},
        "inference_requests_per_minute_per_key": PER_MINUTE, "serving_start_wait_seconds": 0.1})


@pytest.fixture(scope="module")
def second_api(api_settings: Settings, db_url: str) -> Iterator[str]:
    """Another API process's app over the same database (its own caches, its own counts in
    memory, if it kept any)."""
    with ServerThread(create_app(api_settings, enqueue=lambda job_id: None)) as url:
        yield url


def sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


def ask(client: openai.OpenAI) -> None:
    client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}])


def fresh_key(api: Api) -> str:
    """A key of a new tenant, made early enough in a minute that a test's few requests
    share the minute's window."""
    wait_until(lambda: utcnow().second < 45, timeout=20, what="a minute's start")
    with api.session() as s:
        key = create_api_key(s, f"limited-{secrets.token_hex(3)}", "tests")
        s.commit()
    return key


def test_a_key_past_its_requests_a_minute_gets_a_429_with_retry_after(
        api: Api, second_api: str) -> None:
    key = fresh_key(api)
    mine = sdk(api.url, key)
    for _ in range(PER_MINUTE):  # counted, then refused for want of an engine
        with pytest.raises(openai.APIStatusError) as unavailable:
            ask(mine)
        assert unavailable.value.status_code == 503
    with pytest.raises(openai.RateLimitError) as limited:
        ask(sdk(second_api, key))  # another API process: the same count
    r = limited.value.response
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.json()["error"] | {"message": ""} == {
        "message": "", "type": "rate_limit_error", "param": None, "code": "rate_limited"}
    assert f"{PER_MINUTE} requests a minute" in limited.value.message
    with pytest.raises(openai.RateLimitError):
        mine.completions.create(model=BASE, prompt="x")  # completions count alike


def test_the_limit_is_per_key(api: Api) -> None:
    spent, other = fresh_key(api), fresh_key(api)
    for _ in range(PER_MINUTE + 1):
        try:
            ask(sdk(api.url, spent))
        except openai.APIStatusError:
            pass
    with pytest.raises(openai.APIStatusError) as e:
        ask(sdk(api.url, other))
    assert e.value.status_code == 503  # not limited: it reached the (missing) engine


def test_a_window_whose_answers_used_its_tokens_refuses_until_the_next(
        api: Api, db_url: str) -> None:
    settings = api.settings.model_copy(update={"inference_requests_per_minute_per_key": 0,
                                               "inference_tokens_per_minute_per_key": 100})
    subject = rate_limits.key_subject(keys.hash_key(fresh_key(api)))
    engine = make_engine(db_url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    now = utcnow()
    limiter, other_process = rate_limits.InferenceLimiter(), rate_limits.InferenceLimiter()
    with maker() as s:
        admitted = limiter.admit(s, subject, settings, now)
        assert admitted is not None
        limiter.add_tokens(s, admitted, 100, settings)
        with pytest.raises(RetryLater) as e:
            limiter.admit(s, subject, settings, now)
        assert "100 tokens a minute" in e.value.message
        with pytest.raises(RetryLater):  # sent to the row: another process knows them
            other_process.admit(s, subject, settings, now)
        later = limiter.admit(
            s, subject, settings, now.replace(second=0, microsecond=0) + rate_limits.JOB_WINDOW)
        assert later is not None and later.window == admitted.window + 1
        # The key's older windows are gone with its first request of a new one.
        assert [w.window for w in s.query(RateWindow).filter_by(subject=subject)] == [
            later.window]
    engine.dispose()
