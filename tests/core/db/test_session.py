"""The unit of work: commit, then the after-commit hooks; on error, roll back and drop them."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from core.db.models import Tenant
from core.db.session import after_commit, make_engine, unit_of_work


@pytest.fixture
def maker(sqlite_url: str) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(sqlite_url)
    yield sessionmaker(bind=engine, expire_on_commit=False)
    engine.dispose()


def names(maker: sessionmaker[Session]) -> list[str]:
    with maker() as s:
        return list(s.scalars(select(Tenant.name)))


def test_hooks_run_after_the_commit_and_see_its_rows(maker: sessionmaker[Session]) -> None:
    seen: list[list[str]] = []
    with unit_of_work(maker) as s:
        s.add(Tenant(name="committed"))
        after_commit(s, lambda: seen.append(names(maker)))  # reads on its own connection
        assert seen == []
    assert seen == [["committed"]]


def test_an_error_rolls_back_and_drops_the_hooks(maker: sessionmaker[Session]) -> None:
    ran: list[str] = []
    with pytest.raises(RuntimeError), unit_of_work(maker) as s:
        s.add(Tenant(name="rolled-back"))
        s.flush()
        after_commit(s, lambda: ran.append("hook"))
        raise RuntimeError("the request failed")
    assert ran == [] and names(maker) == []


def test_a_failing_hook_is_logged_not_raised(
    maker: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    ran: list[str] = []

    def broken() -> None:
        raise ConnectionError("broker down")

    with caplog.at_level(logging.ERROR), unit_of_work(maker) as s:
        s.add(Tenant(name="kept"))
        after_commit(s, broken)
        after_commit(s, lambda: ran.append("next"))
    assert names(maker) == ["kept"] and ran == ["next"]
    assert "after-commit hook" in caplog.text
