"""Throwaway PostgreSQL databases for tests and benchmarks: on the server at
FTUNE_TEST_PG_ADMIN_URL, or on the one an ``admin_url`` names."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

PG_ADMIN_URL = os.environ.get(
    "FTUNE_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


def create_database(name: str, admin_url: str | None = None) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(admin_url or PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()


def drop_database(name: str, admin_url: str | None = None) -> None:
    """Drop it even while a test's server still holds connections."""
    from sqlalchemy import create_engine, text

    admin = create_engine(admin_url or PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(
            text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
            {"n": name},
        )
        c.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    admin.dispose()


def database_url(name: str, admin_url: str | None = None) -> str:
    """The URL of database ``name`` on the admin URL's server (same user and password)."""
    from sqlalchemy.engine import make_url

    url = make_url(admin_url or PG_ADMIN_URL).set(database=name)
    return url.render_as_string(hide_password=False)


@contextmanager
def migrated_database(prefix: str = "ftune_test", admin_url: str | None = None) -> Iterator[str]:
    """A new database ``<prefix>_<random>``, migrated to head; its URL; dropped on exit."""
    from core.db.migrate import upgrade_head

    name = f"{prefix}_{secrets.token_hex(4)}"
    create_database(name, admin_url)
    try:
        url = database_url(name, admin_url)
        upgrade_head(url)
        yield url
    finally:
        drop_database(name, admin_url)
