"""History does not slow the service: what lists and sums read instead of the whole past.

* usage_days: ended attempts summed per tenant and UTC day (core/jobs/usage.py keeps it as
  attempts end); filled here from the attempts that ended before, in one INSERT ... SELECT.
* job_metadata: each OpenAI metadata pair of a job as a row, indexed in list order
  (api/openai/listing.py); filled here from jobs.openai.
* retention_marks: how far retention got (worker/upkeep/retention.py).
* ix_jobs_tenant_status_created: a job list filtered by status reads only its page.
* ix_jobs_tenant_status_finished: GET /v1/models reads the tenant's latest succeeded jobs in
  order instead of sorting all of them.
* ix_jobs_queue replaces ix_jobs_queue_order: queue order is priority DESC, created_at, id,
  which the old all-ascending index could not give without sorting every queued job.

Every statement is one pass over the tables (a group-by, a JSON expansion, an index build):
seconds on a table of 100,000 jobs, no row read back into Python.

Revision ID: 0015_history
Revises: 0014_commit_notices
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_history"
down_revision = "0014_commit_notices"
branch_labels = None
depends_on = None

UTC_TS = sa.DateTime(timezone=True)
NEW_TABLES = ("usage_days", "job_metadata", "retention_marks")

# The backfills, per dialect. Days are UTC days (PostgreSQL stores timestamptz; SQLite
# stores the UTC wall time as text). Seconds as core/jobs/usage.py counts them: ended minus
# started, never negative.
_USAGE_PG = """
INSERT INTO usage_days (tenant_id, day, attempts, jobs, tokens, loss_tokens, wall_seconds,
                        gpu_seconds)
SELECT j.tenant_id, (a.ended_at AT TIME ZONE 'UTC')::date, count(*), count(DISTINCT a.job_id),
       sum(a.tokens), sum(a.loss_tokens),
       sum(greatest(extract(epoch FROM a.ended_at - a.started_at), 0)),
       sum(greatest(extract(epoch FROM a.ended_at - a.started_at), 0) * a.processes)
FROM job_attempts a JOIN jobs j ON j.id = a.job_id
WHERE a.ended_at IS NOT NULL
GROUP BY j.tenant_id, (a.ended_at AT TIME ZONE 'UTC')::date
"""
_USAGE_SQLITE = """
INSERT INTO usage_days (tenant_id, day, attempts, jobs, tokens, loss_tokens, wall_seconds,
                        gpu_seconds)
SELECT j.tenant_id, date(a.ended_at), count(*), count(DISTINCT a.job_id),
       sum(a.tokens), sum(a.loss_tokens),
       sum(max((julianday(a.ended_at) - julianday(a.started_at)) * 86400.0, 0)),
       sum(max((julianday(a.ended_at) - julianday(a.started_at)) * 86400.0, 0) * a.processes)
FROM job_attempts a JOIN jobs j ON j.id = a.job_id
WHERE a.ended_at IS NOT NULL
GROUP BY j.tenant_id, date(a.ended_at)
"""
_METADATA_PG = """
INSERT INTO job_metadata (job_id, key, tenant_id, value, created_at)
SELECT j.id, m.key, j.tenant_id, m.value, j.created_at
FROM jobs j, jsonb_each_text(j.openai -> 'metadata') m
WHERE jsonb_typeof(j.openai -> 'metadata') = 'object'
"""
_METADATA_SQLITE = """
INSERT INTO job_metadata (job_id, key, tenant_id, value, created_at)
SELECT j.id, m.key, j.tenant_id, m.value, j.created_at
FROM jobs j, json_each(j.openai, '$.metadata') m
WHERE json_type(j.openai, '$.metadata') = 'object'
"""


def upgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "usage_days",
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("day", sa.Date(), primary_key=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("loss_tokens", sa.BigInteger(), nullable=False),
        sa.Column("wall_seconds", sa.Float(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
    )
    op.create_table(
        "job_metadata",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("key", sa.String(64), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("value", sa.String(512), nullable=False),
        sa.Column("created_at", UTC_TS, nullable=False),
    )
    op.create_table(
        "retention_marks",
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("finished_at", UTC_TS, nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
    )
    op.execute(_USAGE_PG if postgres else _USAGE_SQLITE)
    op.execute(_METADATA_PG if postgres else _METADATA_SQLITE)
    op.create_index("ix_job_metadata_lookup", "job_metadata",
                    ["tenant_id", "key", "value", "created_at", "job_id"])
    op.create_index("ix_jobs_tenant_status_created", "jobs",
                    ["tenant_id", "status", "created_at", "id"])
    op.create_index("ix_jobs_tenant_status_finished", "jobs",
                    ["tenant_id", "status", "finished_at"])
    op.drop_index("ix_jobs_queue_order", table_name="jobs")
    op.create_index("ix_jobs_queue", "jobs",
                    ["status", sa.text("priority DESC"), "created_at", "id"])
    if postgres:
        # Commit notices (0014_commit_notices): tables of no job's own rows notify per
        # statement with an empty payload.
        for table in NEW_TABLES:
            op.execute(f"""
                CREATE TRIGGER ftune_notify_commit
                AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
                FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
            """)


def downgrade() -> None:
    op.drop_index("ix_jobs_queue", table_name="jobs")
    op.create_index("ix_jobs_queue_order", "jobs", ["status", "priority", "created_at"])
    op.drop_index("ix_jobs_tenant_status_finished", table_name="jobs")
    op.drop_index("ix_jobs_tenant_status_created", table_name="jobs")
    op.drop_index("ix_job_metadata_lookup", table_name="job_metadata")
    for table in reversed(NEW_TABLES):
        op.drop_table(table)  # its triggers go with it
