"""Inference rate limits taken in leases (api/services/rate_limits.py InferenceLimiter): two
limiters stand for two API processes over one database, on SQLite and PostgreSQL. What a
lease may cost (requests leased and unused count as used) and what it may never do (let a
key past its limit) are both checked."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from datetime import datetime

import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.errors import RetryLater
from api.services import rate_limits
from api.services.rate_limits import InferenceLimiter
from core.db.models import RateWindow, utcnow
from core.infra.settings import Settings
from tests.utils.api import migrated_sessionmaker

RPM = 320  # a lease of 10


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def maker(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[sessionmaker[Session]]:
    """One database a module and dialect: each test counts a key of its own."""
    with migrated_sessionmaker(request.param, tmp_path_factory) as made:
        yield made


@pytest.fixture
def session(maker: sessionmaker[Session]) -> Iterator[Session]:
    with maker() as s:
        yield s


def limits(rpm: int = 0, tpm: int = 0) -> Settings:
    return Settings(inference_requests_per_minute_per_key=rpm,
                    inference_tokens_per_minute_per_key=tpm)


def start_of_minute() -> datetime:
    return utcnow().replace(second=1, microsecond=0)


def row(session: Session, subject: str, now: datetime) -> RateWindow:
    found = session.get(RateWindow, (subject, rate_limits.window_of(now)),
                        populate_existing=True)
    assert found is not None
    return found


def test_a_lease_is_a_32nd_of_the_limit_and_small_limits_count_each_request() -> None:
    assert rate_limits.lease_size(RPM) == 10
    assert rate_limits.lease_size(10_000) == rate_limits.LEASE_MAX
    assert rate_limits.lease_size(63) == 1
    assert rate_limits.lease_size(None) == rate_limits.LEASE_MAX  # tokens only


def test_a_process_writes_the_row_once_a_lease(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    limiter = InferenceLimiter()
    for _ in range(10):
        assert limiter.admit(session, subject, settings, now) is not None
    assert row(session, subject, now).requests == 10  # one lease, ten requests
    limiter.admit(session, subject, settings, now)
    assert row(session, subject, now).requests == 20


def test_a_lease_admits_without_the_database_until_it_is_used_up(session: Session) -> None:
    """admit_held: what the API decides on its event loop (no thread, no connection)."""
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    limiter = InferenceLimiter()
    assert limiter.admit_held(subject, limits(), now) is None  # no limit set
    assert limiter.admit_held(subject, settings, now) is rate_limits.NEEDS_ROW  # no lease yet
    assert limiter.admit(session, subject, settings, now) is not None  # takes a lease of 10
    for _ in range(9):
        assert isinstance(limiter.admit_held(subject, settings, now), rate_limits.Admitted)
    assert limiter.admit_held(subject, settings, now) is rate_limits.NEEDS_ROW  # used up
    assert row(session, subject, now).requests == 10


def test_two_processes_never_let_a_key_past_its_limit(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    first, second = InferenceLimiter(), InferenceLimiter()
    admitted = {"first": 0, "second": 0}
    refused = set()
    for i in range(2 * RPM):
        name, limiter = ("first", first) if i % 3 else ("second", second)
        try:
            limiter.admit(session, subject, settings, now)
            admitted[name] += 1
        except RetryLater as e:
            assert f"{RPM} requests a minute" in e.message
            refused.add(name)
    assert refused == {"first", "second"}
    # Leased and unused counts as used: at most a lease less than the limit per process.
    total = sum(admitted.values())
    assert RPM - 2 * (rate_limits.lease_size(RPM) - 1) <= total <= RPM
    assert row(session, subject, now).requests == RPM


def test_the_last_requests_of_a_minute_are_taken_one_by_one(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    other = InferenceLimiter()
    with session.begin():
        session.add(RateWindow(subject=subject, window=rate_limits.window_of(now),
                               requests=RPM - 3, tokens=0))
    for _ in range(3):  # fewer left than a lease: each still let through
        assert other.admit(session, subject, settings, now) is not None
    with pytest.raises(RetryLater):
        other.admit(session, subject, settings, now)
    assert row(session, subject, now).requests == RPM


def test_tokens_reach_the_row_once_past_a_32nd_of_the_limit(
        session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rate_limits, "TOKEN_SYNC_SECONDS", 3600.0)  # by amount alone here
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(0, 3200)
    here, there = InferenceLimiter(), InferenceLimiter()
    admitted = here.admit(session, subject, settings, now)
    assert admitted is not None
    here.add_tokens(session, admitted, 50, settings)
    here.add_tokens(session, admitted, 40, settings)
    assert row(session, subject, now).tokens == 0  # 90 kept in memory
    here.add_tokens(session, admitted, 20, settings)  # 110 unsent >= 100: sent
    assert row(session, subject, now).tokens == 110
    here.add_tokens(session, admitted, 3090, settings)
    for limiter in (here, there):  # both processes refuse the spent window
        with pytest.raises(RetryLater) as e:
            limiter.admit(session, subject, settings, now)
        assert "3200 tokens a minute" in e.value.message


def test_tokens_a_second_old_are_sent_whatever_their_amount(
        session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rate_limits, "TOKEN_SYNC_SECONDS", 0.0)
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(0, 3200)
    limiter = InferenceLimiter()
    admitted = limiter.admit(session, subject, settings, now)
    assert admitted is not None
    limiter.add_tokens(session, admitted, 5, settings)
    assert row(session, subject, now).tokens == 5


def test_a_new_minute_starts_a_new_lease(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    limiter = InferenceLimiter()
    limiter.admit(session, subject, settings, now)
    later = now.replace(second=0) + rate_limits.JOB_WINDOW
    admitted = limiter.admit(session, subject, settings, later)
    assert admitted is not None and admitted.window == rate_limits.window_of(now) + 1
    assert row(session, subject, later).requests == 10
    assert session.query(RateWindow).filter_by(subject=subject).count() == 1


def test_a_lease_used_below_half_is_topped_up_before_it_runs_out(session: Session) -> None:
    """wants_more, then top_up (in the background, in the API): a key in steady use never
    waits for the row."""
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    limiter = InferenceLimiter()
    limiter.admit(session, subject, settings, now)  # a lease of 10, 9 left
    for _ in range(4):
        limiter.admit_held(subject, settings, now)
        assert not limiter.wants_more(subject, settings)  # 5 left: half a lease
    limiter.admit_held(subject, settings, now)  # 4 left
    assert limiter.wants_more(subject, settings)
    assert not limiter.wants_more(subject, settings)  # one top-up at a time
    limiter.top_up(session, subject, settings, now)
    assert row(session, subject, now).requests == 20
    for _ in range(14):  # what was left and the new lease, without the database
        assert isinstance(limiter.admit_held(subject, settings, now), rate_limits.Admitted)
    assert limiter.admit_held(subject, settings, now) is rate_limits.NEEDS_ROW


def test_a_top_up_of_a_spent_minute_refuses_no_one(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    limiter = InferenceLimiter()
    limiter.admit(session, subject, settings, now)
    with session.begin():
        row(session, subject, now).requests = RPM  # another process took the rest
    limiter.top_up(session, subject, settings, now)  # nothing to take: no error
    for _ in range(9):  # the lease it held is still its own
        assert isinstance(limiter.admit_held(subject, settings, now), rate_limits.Admitted)
    with pytest.raises(RetryLater):  # then the row says no
        limiter.admit(session, subject, settings, now)


def test_a_lease_of_one_is_never_topped_up(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(60)
    limiter = InferenceLimiter()
    limiter.admit(session, subject, settings, now)
    assert not limiter.wants_more(subject, settings)


def test_two_processes_topping_up_never_let_a_key_past_its_limit(session: Session) -> None:
    subject, now, settings = f"key:{secrets.token_hex(8)}", start_of_minute(), limits(RPM)
    first, second = InferenceLimiter(), InferenceLimiter()
    total = 0
    for i in range(2 * RPM):
        limiter = first if i % 3 else second
        try:
            limiter.admit(session, subject, settings, now)
            total += 1
        except RetryLater:
            continue
        if limiter.wants_more(subject, settings):
            limiter.top_up(session, subject, settings, now)
    size = rate_limits.lease_size(RPM)
    assert RPM - 2 * (size + size // 2 - 1) <= total <= RPM
    assert row(session, subject, now).requests == RPM
