"""Throwaway PostgreSQL databases for tests (the server at FTUNE_TEST_PG_ADMIN_URL)."""

from __future__ import annotations

import os

PG_ADMIN_URL = os.environ.get(
    "FTUNE_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def create_database(name: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()


def drop_database(name: str) -> None:
    """Drop it even while a test's server still holds connections."""
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
            {"n": name},
        )
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def database_url(name: str) -> str:
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
