"""The schema comes from Alembic: head matches the models, and downgrade/upgrade round-trips."""

from __future__ import annotations

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

# Serving's tables live beside their code (core/db/models.py cannot import core/serving, which
# sits above it); importing them registers them on Base.metadata, which the comparison reads.
import core.serving.tables  # noqa: F401
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


def _history_before_0015(url: str) -> None:
    """Jobs, attempts and OpenAI metadata as 0014 held them, written with 0014's columns."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import text

    t0 = datetime(2026, 3, 1, 23, 0, tzinfo=UTC)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, created_at) VALUES "
                          "('ten-a', 'a', :t), ('ten-b', 'b', :t)"), {"t": t0})
        for job, tenant, openai in (("job-1", "ten-a", '{"metadata": {"team": "x", "run": "1"}}'),
                                    ("job-2", "ten-a", None), ("job-3", "ten-b", '{"metadata": null}')):
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, status, spec, priority, created_at, attempt, "
                "pauses, paused_seconds, events_offset, step, openai) VALUES "
                "(:id, :tenant, 'succeeded', '{}', 0, :t, 1, 0, 0, 0, 0, :openai)"),
                {"id": job, "tenant": tenant, "t": t0, "openai": openai})
        attempts = (("job-1", 1, t0, 1800, 2, 10), ("job-1", 2, t0 + timedelta(hours=2), 60, 1, 5),
                    ("job-2", 1, t0 + timedelta(hours=1), 90, 4, 7),
                    ("job-3", 1, t0, 30, 1, 99))
        for job, n, start, seconds, processes, tokens in attempts:
            conn.execute(text(
                "INSERT INTO job_attempts (job_id, attempt, started_at, ended_at, processes, "
                "tokens, loss_tokens) VALUES (:job, :n, :start, :end, :p, :tokens, 1)"),
                {"job": job, "n": n, "start": start, "end": start + timedelta(seconds=seconds),
                 "p": processes, "tokens": tokens})
    engine.dispose()


def _check_0015_backfill(url: str) -> None:
    from datetime import date

    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from core.db.models import JobMetadata
    from core.jobs.usage import recount_days, tenant_days

    engine = create_engine(url)
    with Session(engine) as s:
        first, last = date(2026, 3, 1), date(2026, 3, 2)
        for tenant in ("ten-a", "ten-b"):
            kept = [(d, t.attempts, t.job_count, t.tokens, round(t.gpu_seconds, 3))
                    for d, t in tenant_days(s, tenant, first, last)]
            recount = [(d, t.attempts, t.job_count, t.tokens, round(t.gpu_seconds, 3))
                       for d, t in recount_days(s, tenant, first, last)]
            assert kept == recount
        assert [r[1:4] for r in kept] == [(1, 1, 99), (0, 0, 0)]  # ten-b
        pairs = {(m.job_id, m.key, m.value, m.tenant_id)
                 for m in s.scalars(select(JobMetadata))}
        assert pairs == {("job-1", "team", "x", "ten-a"), ("job-1", "run", "1", "ten-a")}
    engine.dispose()


def test_0015_fills_day_sums_and_metadata_from_the_history_on_sqlite(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    cfg = alembic_config(url)
    command.upgrade(cfg, "0014_commit_notices")
    _history_before_0015(url)
    command.upgrade(cfg, "head")
    _check_0015_backfill(url)


def test_0015_fills_day_sums_and_metadata_from_the_history_on_postgres() -> None:
    from testkit.pg import migrated_database

    with migrated_database("ftune_migrations") as url:
        cfg = alembic_config(url)
        command.downgrade(cfg, "0014_commit_notices")
        _history_before_0015(url)
        command.upgrade(cfg, "head")
        _check_0015_backfill(url)


def _history_before_0019(url: str) -> None:
    """Jobs of several statuses and day sums, written straight into the tables (as 0018
    held them, with no kept counts)."""
    from datetime import date

    from sqlalchemy import text

    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, created_at) VALUES "
                          "('ten-a', 'a', '2026-03-01'), ('ten-b', 'b', '2026-03-01')"))
        statuses = ["succeeded"] * 20 + ["failed"] * 3 + ["queued"] * 5 + ["running"] * 2
        for i, status in enumerate(statuses):
            conn.execute(text(
                "INSERT INTO jobs (id, tenant_id, status, spec, priority, created_at, attempt, "
                "pauses, paused_seconds, events_offset, step) VALUES "
                "(:id, 'ten-a', :status, '{}', 0, '2026-03-01', 1, 0, 0, 0, 0)"),
                {"id": f"job-{i:024x}", "status": status})
        for tenant, day, tokens in (("ten-a", date(2026, 3, 1), 10), ("ten-a", date(2026, 3, 2), 5),
                                    ("ten-b", date(2026, 3, 1), 99)):
            conn.execute(text(
                "INSERT INTO usage_days (tenant_id, day, attempts, jobs, tokens, loss_tokens, "
                "wall_seconds, gpu_seconds) VALUES (:t, :d, 2, 1, :tokens, 1, 60.5, 121.0)"),
                {"t": tenant, "d": day, "tokens": tokens})
    engine.dispose()


def _check_0019_backfill(url: str) -> None:
    from sqlalchemy import func, select
    from sqlalchemy.orm import Session

    from core.db.models import Job, JobStatusCount
    from core.jobs import state as jobstate
    from core.jobs.usage import ended_totals_by_tenant, recount_totals_by_tenant

    engine = create_engine(url)
    with Session(engine) as s:
        assert jobstate.counts_by_status(s) == jobstate.recount_by_status(s) == {
            "succeeded": 20, "failed": 3, "queued": 5, "running": 2}
        shard = func.substr(Job.id, func.length(Job.id), 1)
        recount = set(s.execute(select(Job.status, shard, func.count())
                                .group_by(Job.status, shard)).tuples())
        kept = set(s.execute(select(JobStatusCount.status, JobStatusCount.shard,
                                    JobStatusCount.jobs)).tuples())
        assert kept == recount and len(kept) > 4  # per shard: ids end in 16 digits
        totals = ended_totals_by_tenant(s)
        assert totals == recount_totals_by_tenant(s)
        assert (totals["ten-a"].tokens, totals["ten-a"].attempts, totals["ten-b"].tokens) == (
            15, 4, 99)
    engine.dispose()


def test_0019_fills_kept_counts_from_the_history_on_sqlite(sqlite_url: str) -> None:
    _history_before_0019(sqlite_url)
    cfg = alembic_config(sqlite_url)
    command.downgrade(cfg, "0018_job_evaluation")
    command.upgrade(cfg, "head")
    _check_0019_backfill(sqlite_url)
    assert _diff(sqlite_url) == []


def test_0019_fills_kept_counts_from_the_history_on_postgres() -> None:
    from testkit.pg import migrated_database

    with migrated_database("ftune_migrations") as url:
        _history_before_0019(url)
        cfg = alembic_config(url)
        command.downgrade(cfg, "0018_job_evaluation")
        command.upgrade(cfg, "head")
        _check_0019_backfill(url)
        assert _diff(url) == []
