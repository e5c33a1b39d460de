"""Engine and sessions. One engine per process, built from the settings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.settings import get_settings

log = logging.getLogger(__name__)

_AFTER_COMMIT = "ftune.after_commit"


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # The API, the worker and the monitor thread write concurrently: WAL lets readers
        # run beside the writer, and busy_timeout makes writers queue instead of failing.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


@lru_cache(maxsize=1)
def get_engine() -> Engine:
    settings = get_settings()
    assert settings.database_url is not None
    if settings.is_sqlite:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return make_engine(settings.database_url)


@lru_cache(maxsize=1)
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


def reset_engine_cache() -> None:
    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()
    get_sessionmaker.cache_clear()


def after_commit(session: Session, hook: Callable[[], None]) -> None:
    """Run ``hook`` once the session's unit of work has committed; never if it rolls back.
    Side effects that others act on (enqueueing a job) must not run before the rows they
    refer to are visible."""
    session.info.setdefault(_AFTER_COMMIT, []).append(hook)


def commit(session: Session) -> None:
    """Commit, then run the after-commit hooks. A failing hook is logged, not raised: what
    it was for is committed, and the hooks' owners make a lost one only a delay."""
    session.commit()
    hooks: list[Callable[[], None]] = session.info.pop(_AFTER_COMMIT, [])
    for hook in hooks:
        try:
            hook()
        except Exception:
            log.exception("after-commit hook %r failed", hook)


def rollback(session: Session) -> None:
    """Roll back, and forget the after-commit hooks: what they were for never happened."""
    session.info.pop(_AFTER_COMMIT, None)
    session.rollback()


@contextmanager
def unit_of_work(maker: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success (then the after-commit hooks), roll back on
    error, always close."""
    session = maker()
    try:
        yield session
        commit(session)
    except BaseException:
        rollback(session)
        raise
    finally:
        session.close()


def session_scope() -> AbstractContextManager[Session]:
    """A unit of work on the process's engine."""
    return unit_of_work(get_sessionmaker())


def execute_rowcount(session: Session, statement: Executable) -> int:
    """Execute an UPDATE or DELETE and return how many rows it matched.

    For DML, ``Session.execute`` returns a ``CursorResult`` (which has ``rowcount``), but
    SQLAlchemy 2.1 types it as plain ``Result``: the cast says what it is at runtime."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount
