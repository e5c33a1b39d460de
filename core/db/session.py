"""Engine and sessions. One engine per process, built from the settings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import CursorResult, Engine, Executable, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from core.settings import get_settings


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


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error, always close."""
    session = get_sessionmaker()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def execute_rowcount(session: Session, statement: Executable) -> int:
    """Execute an UPDATE or DELETE and return how many rows it matched.

    For DML, ``Session.execute`` returns a ``CursorResult`` (which has ``rowcount``), but
    SQLAlchemy 2.1 types it as plain ``Result``: the cast says what it is at runtime."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount
