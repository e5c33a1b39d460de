"""The schema comes from Alembic: head matches the models, and downgrade/upgrade round-trips."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from core.db.migrate import alembic_config
from core.db.models import Base


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    return diff


def test_head_matches_models_on_sqlite(sqlite_url: str) -> None:
    assert _diff(sqlite_url) == []


def test_head_matches_models_on_postgres(pg_url: str) -> None:
    assert _diff(pg_url) == []


def test_downgrade_to_base_and_back(sqlite_url: str) -> None:
    cfg = alembic_config(sqlite_url)
    command.downgrade(cfg, "base")
    command.upgrade(cfg, "head")
    assert _diff(sqlite_url) == []


def test_downgrade_to_base_and_back_on_postgres() -> None:
    from testkit.pg import migrated_database

    with migrated_database("ftune_migrations") as url:  # its own: base drops every table
        cfg = alembic_config(url)
        command.downgrade(cfg, "base")
        command.upgrade(cfg, "head")
        assert _diff(url) == []
